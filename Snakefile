# evident: one target runs a campaign and leaves a sealed evidence directory.
#   snakemake -c2                                   # the default campaign (config/config.yaml)
#   snakemake -c2 --configfile config/campaigns/X.yaml
from snakemake.utils import min_version

from workflow.campaign import validate_campaign

min_version("9.0")

# A campaign file replaces the default campaign whole (no silent inheritance of its model); the
# path is relative to this file, so `snakemake -s PATH/Snakefile -d WORKDIR` works too.
if not workflow.overwrite_configfiles:

    configfile: f"{workflow.basedir}/config/config.yaml"


# An unknown key or a bad value stops the run here, before any work, naming the key.
validate_campaign(config, f"{workflow.basedir}/config/schema.yaml")


include: "workflow/rules/common.smk"


# A sealed directory is never recomputed: its stages are not even defined, only the gate reads it.
if not SEALED:

    include: "workflow/rules/context.smk"
    include: "workflow/rules/checkpoint.smk"
    include: "workflow/rules/oracle.smk"
    include: "workflow/rules/parity.smk"
    include: "workflow/rules/compare.smk"
    include: "workflow/rules/bench.smk"
    include: "workflow/rules/serve_bench.smk"
    include: "workflow/rules/bench_report.smk"
    include: "workflow/rules/overlap.smk"
    include: "workflow/rules/kernel_audit.smk"
    include: "workflow/rules/quality.smk"
    include: "workflow/rules/profile.smk"
    include: "workflow/rules/seal.smk"


include: "workflow/rules/gate.smk"
include: "workflow/rules/archive.smk"


rule all:
    input:
        GATE,
        INDEX,
    default_target: True
