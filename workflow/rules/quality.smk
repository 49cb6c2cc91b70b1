# GSM8K on each quality target (hf in process, the engine through its endpoint, any endpoint URL), then the
# quality gate of every candidate against the reference. The stage starts and stops the engine's server itself.


rule quality:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
        data=quality_data(),
    output:
        results=[f"{E}/{layout.quality_result(t)}" for t in QUALITY_TARGETS],
        rows=[f"{E}/{layout.quality_rows(t)}" for t in QUALITY_TARGETS],
        gate=f"{E}/{layout.QUALITY_GATE}",
    # hf in process, then the engine server as a second process: one core each at most at a time
    threads: ALONE if USES_GPU else 1
    resources:
        **job_resources(gpu=1),
    params:
        py=on_gpus(1),
        ev=evidence_dir,
        args=quality_args,
    log:
        f"{E}/{layout.log('quality')}",
    benchmark:
        f"{E}/{layout.benchmark('quality')}"
    shell:
        "{params.py} -m evident.workflow.stages.quality --checkpoint {input.ckpt} --evidence {params.ev} {params.args} 2>&1 | tee {log}"
