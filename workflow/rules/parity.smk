# Engine runs per backend and kernels setting (one job loops over the batch sizes; each is also teacher-forced
# along the oracle's traces); compare.smk holds them to the oracle.
rule parity:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
        oracle=rules.oracle.output,
    output:
        [f"{E}/{layout.parity_run(f'{{backend}}{{kernels}}-b{b}')}" for b in config["parity"]["batch_sizes"]],
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
        f"{E}/{layout.log('parity-{backend}{kernels}')}",
    benchmark:
        f"{E}/{layout.benchmark('parity-{backend}{kernels}')}"
    shell:
        "{params.launch} -m evident.workflow.stages.parity --checkpoint {input.ckpt} --evidence {params.ev} "
        "--backend {wildcards.backend} --kernels {params.kernels} --batch-sizes {params.batch_sizes} 2>&1 | tee {log}"


# An engine target of `engines:` (workflow/plan/targets.py) on the same cases, each its own job: its server (a url, or its
# serve command started and stopped by the stage) or its command; compare.smk holds it to the oracle with the rest.
rule parity_target:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
        oracle=rules.oracle.output,
    output:
        [f"{E}/{layout.parity_run(f'{{target}}-b{b}')}" for b in config["parity"]["batch_sizes"]],
    wildcard_constraints:
        target="|".join(map(re.escape, PARITY_TARGETS)) or "(?!)",
    # the stage waits on its target; a served or command target is a second process, holding the GPU on a GPU campaign
    threads: 1
    resources:
        **job_resources(gpu=target_gpus),
    params:
        py=lambda wildcards: on_gpus(target_gpus(wildcards)),
        ev=evidence_dir,
        spec=lambda wildcards: shlex.quote(json.dumps(PARITY_TARGETS[wildcards.target])),
        batch_sizes=",".join(map(str, config["parity"]["batch_sizes"])),
    log:
        f"{E}/{layout.log('parity-{target}')}",
    benchmark:
        f"{E}/{layout.benchmark('parity-{target}')}"
    shell:
        "{params.py} -m evident.workflow.stages.parity_target --checkpoint {input.ckpt} --evidence {params.ev} "
        "--spec {params.spec} --batch-sizes {params.batch_sizes} 2>&1 | tee {log}"
