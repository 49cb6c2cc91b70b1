# Checkpoint fetch (cached, shared by evidence directories) and its record in the evidence.
if config["checkpoint"]["source"] != "local":

    rule fetch_checkpoint:
        output:
            directory(CKPT),
        # synthetic weights are drawn, trained ones trained, on the campaign's device (training: train.threads)
        threads: config["checkpoint"].get("train", {}).get("threads", 1)
        resources:
            **job_resources(gpu=1),
        params:
            py=on_gpus(1),
            spec=json.dumps(config["checkpoint"], sort_keys=True),
            dtype=config["dtype"],
            device=config["device"],
        log:
            f"{CKPT}.log",
        benchmark:
            f"{CKPT}.benchmark.tsv"
        shell:
            "{params.py} -m evident.workflow.stages.checkpoint fetch --spec-json {params.spec:q} --dtype {params.dtype} --device {params.device} --out {output} 2>&1 | tee {log}"


rule record_checkpoint:
    input:
        ckpt=CKPT,
        config=rules.context.output.config,
    output:
        f"{E}/{layout.CHECKPOINT}",
    resources:
        **job_resources(),
    params:
        py=PY,
        ev=evidence_dir,
    log:
        f"{E}/{layout.log('checkpoint')}",
    benchmark:
        f"{E}/{layout.benchmark('checkpoint')}"
    shell:
        "{params.py} -m evident.workflow.stages.checkpoint record --checkpoint {input.ckpt} --evidence {params.ev} 2>&1 | tee {log}"
