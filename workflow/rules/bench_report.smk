# The benchmark table, plot and the comparison against a baseline; the HTTP cells (serve_bench.smk) beside the
# in-process ones.
rule bench_report:
    input:
        cells=BENCH + HTTP_BENCH,
    output:
        csv=f"{E}/bench/summary.csv",
        plot=f"{E}/plots/bench.png",
        baseline=f"{E}/bench/baseline.json",
    resources:
        **job_resources(),
    params:
        py=PY,
        ev=evidence_dir,
        baseline="--baseline '{}'".format(config["bench"]["baseline"]) if config["bench"]["baseline"] else "",
    log:
        f"{E}/logs/bench_report.log",
    benchmark:
        f"{E}/logs/bench_report.benchmark.tsv"
    shell:
        "{params.py} -m evident.workflow.stages.bench_report --evidence {params.ev} {params.baseline} {input.cells} 2>&1 | tee {log}"
