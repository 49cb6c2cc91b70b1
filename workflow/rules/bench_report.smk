# The benchmark table, plot and the comparison against a baseline; the HTTP cells (serve_bench.smk) beside the
# in-process ones.
rule bench_report:
    input:
        cells=BENCH + HTTP_BENCH,
    output:
        csv=f"{E}/{layout.BENCH_TABLE}",
        plot=f"{E}/{layout.BENCH_PLOT}",
        baseline=f"{E}/{layout.BASELINE}",
    resources:
        **job_resources(),
    params:
        py=PY,
        ev=evidence_dir,
        baseline="--baseline '{}'".format(config["bench"]["baseline"]) if config["bench"]["baseline"] else "",
    log:
        f"{E}/{layout.log('bench_report')}",
    benchmark:
        f"{E}/{layout.benchmark('bench_report')}"
    shell:
        "{params.py} -m evident.workflow.stages.bench_report --evidence {params.ev} {params.baseline} {input.cells} 2>&1 | tee {log}"
