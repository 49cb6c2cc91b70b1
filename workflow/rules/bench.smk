# Batched decode benchmark per backend, a cell per batch size and prompt contract (the table, plot and baseline
# comparison: bench_report.smk).
rule bench:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
        env=rules.context.output.env,
        # the rows check's near-tie margin is parity's, measured from the oracle's record (bench.rows_margin)
        oracle=rules.oracle.output if "oracle" in config["stages"] else [],
    output:
        [f"{E}/{layout.bench_cell(runs.bench_cell('{backend}', b, p))}" for p in runs.bench_contracts(config["bench"])
         for b in config["bench"]["batch_sizes"]],
    wildcard_constraints:
        backend=runs.wildcard_constraints(runs.BENCH_BACKENDS)["backend"],
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
        f"{E}/{layout.log('bench-{backend}')}",
    benchmark:
        f"{E}/{layout.benchmark('bench-{backend}')}"
    shell:
        "{params.launch} -m evident.workflow.stages.bench --checkpoint {input.ckpt} --evidence {params.ev} "
        "--backend {wildcards.backend} --kernels {params.kernels} --batch-sizes {params.batch_sizes} 2>&1 | tee {log}"
