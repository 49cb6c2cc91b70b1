# Resource audit of the Triton kernels at the campaign model's shapes (skipped, with the reason, on a CPU).


rule kernel_audit:
    input:
        ckpt=CKPT,
        config=rules.context.output.config,
    output:
        f"{E}/kernels/audit.json",
    params:
        py=PY,
        ev=evidence_dir,
    log:
        f"{E}/logs/kernel-audit.log",
    benchmark:
        f"{E}/logs/kernel-audit.benchmark.tsv"
    shell:
        "{params.py} -m workflow.stages.kernel_audit --checkpoint {input.ckpt} --evidence {params.ev} 2>&1 | tee {log}"
