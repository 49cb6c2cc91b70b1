# The engine runs against the oracle: the parity verdict, per cell (parity/comparison.json).
rule compare:
    input:
        oracle=rules.oracle.output,
        runs=PARITY,
    output:
        f"{E}/{layout.COMPARISON}",
    resources:
        **job_resources(),
    params:
        py=PY,
        ev=evidence_dir,
    log:
        f"{E}/{layout.log('compare')}",
    benchmark:
        f"{E}/{layout.benchmark('compare')}"
    shell:
        "{params.py} -m evident.workflow.stages.compare --evidence {params.ev} {input.runs} 2>&1 | tee {log}"
