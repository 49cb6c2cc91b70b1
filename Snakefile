# evident: one target runs a campaign and leaves a sealed evidence directory.
#   snakemake -c2                                   # the default campaign (config/config.yaml)
#   snakemake -c2 --configfile config/campaigns/X.yaml
import sys

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.utils import min_version

from evident.workflow.plan.campaign import validate_campaign

min_version("9.0")

# A campaign file replaces the default campaign whole (no silent inheritance of its model); the
# path is relative to this file, so `snakemake -s PATH/Snakefile -d WORKDIR` works too.
if not workflow.overwrite_configfiles:

    configfile: f"{workflow.basedir}/config/config.yaml"


# An unknown key or a bad value stops the run here, before any work, naming the key: the message alone, logged as
# Snakemake logs its errors (stdout in a dry run), without its traceback of this line, and its exit status 1.
# Nothing exists yet to clean up: the locks and incomplete marks come later. --config's values are read by the
# schema's types (Snakemake reads a nested one's scalars as strings).
try:
    validate_campaign(config, f"{workflow.basedir}/config/schema.yaml", workflow.config_settings.config)
except WorkflowError as e:
    logger.error(str(e))
    sys.exit(1)


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
    include: "workflow/rules/soak.smk"
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
