# Engine runs per backend and kernels setting (one job loops over the batch sizes; each is also teacher-forced
# along the oracle's traces), then the comparison against the oracle.


rule parity:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
        oracle=rules.oracle.output,
    output:
        [f"{E}/parity/{{run}}-b{b}.json" for b in config["parity"]["batch_sizes"]],
    wildcard_constraints:
        run="(single|host-staged|collective)(-triton|-graph)?",
    # one core per rank, so Snakemake does not run more processes than cores beside it
    threads: lambda wildcards: 1 if backend_of(wildcards) == "single" else config["parallel"]["ep_size"]
    # on GPUs one device per rank
    resources:
        **job_resources(gpu=engine_gpus),
    params:
        launch=launcher,
        ev=evidence_dir,
        backend=backend_of,
        kernels=kernels_of,
        batch_sizes=",".join(map(str, config["parity"]["batch_sizes"])),
    log:
        f"{E}/logs/parity-{{run}}.log",
    benchmark:
        f"{E}/logs/parity-{{run}}.benchmark.tsv"
    shell:
        "{params.launch} -m workflow.stages.parity --checkpoint {input.ckpt} --evidence {params.ev} "
        "--backend {params.backend} --kernels {params.kernels} --batch-sizes {params.batch_sizes} 2>&1 | tee {log}"


rule compare:
    input:
        oracle=rules.oracle.output,
        runs=PARITY,
    output:
        f"{E}/parity/comparison.json",
    resources:
        **job_resources(),
    params:
        py=PY,
        ev=evidence_dir,
    log:
        f"{E}/logs/compare.log",
    benchmark:
        f"{E}/logs/compare.benchmark.tsv"
    shell:
        "{params.py} -m workflow.stages.compare --evidence {params.ev} {input.runs} 2>&1 | tee {log}"
