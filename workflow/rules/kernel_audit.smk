# Resource audit of the Triton kernels at the campaign model's shapes (skipped, with the reason, on a CPU).


rule kernel_audit:
    input:
        ckpt=CKPT,
        config=rules.context.output.config,
    output:
        f"{E}/{layout.AUDIT}",
    # compiles the kernels for the campaign's GPU
    resources:
        **job_resources(gpu=1),
    params:
        py=on_gpus(1),
        ev=evidence_dir,
    log:
        f"{E}/{layout.log('kernel_audit')}",
    benchmark:
        f"{E}/{layout.benchmark('kernel_audit')}"
    shell:
        "{params.py} -m evident.workflow.stages.kernel_audit --checkpoint {input.ckpt} --evidence {params.ev} 2>&1 | tee {log}"
