# Engine runs per backend and kernels setting (one job loops over the batch sizes; each is also teacher-forced
# along the oracle's traces); compare.smk holds them to the oracle.
rule parity:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
        oracle=rules.oracle.output,
    output:
        [f"{E}/parity/{{backend}}{{kernels}}-b{b}.json" for b in config["parity"]["batch_sizes"]],
    wildcard_constraints:
        **runs.wildcard_constraints(runs.BACKENDS),
    # one core per rank, so Snakemake does not run more processes than cores beside it
    threads: lambda wildcards: 1 if wildcards.backend in runs.ONE_PROCESS else config["parallel"]["ep_size"]
    # on GPUs one device per rank
    resources:
        **job_resources(gpu=engine_gpus),
    params:
        launch=launcher,
        ev=evidence_dir,
        kernels=lambda wildcards: runs.kernels_of(wildcards.kernels),
        batch_sizes=",".join(map(str, config["parity"]["batch_sizes"])),
    log:
        f"{E}/logs/parity-{{backend}}{{kernels}}.log",
    benchmark:
        f"{E}/logs/parity-{{backend}}{{kernels}}.benchmark.tsv"
    shell:
        "{params.launch} -m workflow.stages.parity --checkpoint {input.ckpt} --evidence {params.ev} "
        "--backend {wildcards.backend} --kernels {params.kernels} --batch-sizes {params.batch_sizes} 2>&1 | tee {log}"
