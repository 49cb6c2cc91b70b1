# The gate reads the sealed manifest only: `parity.require_exact` fails the run after sealing. A few
# milliseconds of work: under a cluster executor it runs where Snakemake runs, not as a cluster job.


localrules:
    gate,


rule gate:
    input:
        f"{E}/MANIFEST.json",
    output:
        GATE,
    resources:
        **job_resources(),
    params:
        py=PY,
        ev=evidence_dir,
    log:
        f"{SEAL_LOGS}/gate.log",
    benchmark:
        f"{SEAL_LOGS}/gate.benchmark.tsv"
    shell:
        "{params.py} -m evident.workflow.stages.gate --evidence {params.ev} --out {output} 2>&1 | tee {log}"
