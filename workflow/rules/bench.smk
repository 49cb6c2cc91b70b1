# Batched decode benchmark per backend, then the table, plot and baseline comparison.


rule bench:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
        env=rules.context.output.env,
    output:
        [f"{E}/bench/{{run}}-b{b}.json" for b in config["bench"]["batch_sizes"]],
    wildcard_constraints:
        run="single|host-staged|collective|hf",
    # All cores: no other job runs beside a timing run (Snakemake's way to make a job exclusive; under a
    # cluster executor, resources.cpus, and the Slurm profile asks for the node alone). On GPUs a device per rank.
    threads: ALONE
    resources:
        **job_resources(gpu=engine_gpus),
    params:
        launch=launcher,
        ev=evidence_dir,
        batch_sizes=",".join(map(str, config["bench"]["batch_sizes"])),
        kernels=config["bench"]["kernels"],
    log:
        f"{E}/logs/bench-{{run}}.log",
    benchmark:
        f"{E}/logs/bench-{{run}}.benchmark.tsv"
    shell:
        "{params.launch} -m workflow.stages.bench --checkpoint {input.ckpt} --evidence {params.ev} "
        "--backend {wildcards.run} --kernels {params.kernels} --batch-sizes {params.batch_sizes} 2>&1 | tee {log}"


rule bench_report:
    input:
        cells=BENCH,
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
        f"{E}/logs/bench-report.log",
    benchmark:
        f"{E}/logs/bench-report.benchmark.tsv"
    shell:
        "{params.py} -m workflow.stages.bench_report --evidence {params.ev} {params.baseline} {input.cells} 2>&1 | tee {log}"
