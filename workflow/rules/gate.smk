# The gate reads the sealed manifest only: `parity.require_exact` fails the run after sealing. A few
# milliseconds of work: under a cluster executor it runs where Snakemake runs, not as a cluster job.
#
# Its record is written for every sealed run, passing or failing (with why it failed): a side file, not an output,
# since Snakemake deletes a failed job's outputs. The rule's output is a marker written only on a pass, which is what
# `rule all` asks for (GATE), so a failing run is still a failed job and is asked for again.


localrules:
    gate,


rule gate:
    input:
        f"{E}/{layout.MANIFEST}",
    output:
        GATE,
    resources:
        **job_resources(),
    params:
        py=PY,
        ev=evidence_dir,
        record=GATE_RECORD,
    log:
        f"{SEAL_LOGS}/gate.log",
    benchmark:
        f"{SEAL_LOGS}/gate.benchmark.tsv"
    shell:
        "{params.py} -m evident.workflow.stages.gate --evidence {params.ev} --out {params.record} --passed {output} "
        "2>&1 | tee {log}"
