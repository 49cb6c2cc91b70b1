# Kernel-level capture around a few decode steps of the engine: ncu (--clock-control none), else nsys, else
# torch.profiler; the kernel table, a plot and the top kernels in SUMMARY.md.


rule profile:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
        env=rules.context.output.env,
    output:
        capture=f"{E}/{layout.CAPTURE}",
        kernels=f"{E}/{layout.KERNEL_TABLE}",
        plot=f"{E}/{layout.PROFILE_PLOT}",
    # A capture times kernels: no other job beside it on a GPU; on the CPU it only needs one core's worth.
    threads: ALONE if USES_GPU else 1
    resources:
        **job_resources(gpu=1),
    params:
        py=on_gpus(1),
        ev=evidence_dir,
    log:
        f"{E}/{layout.log('profile')}",
    benchmark:
        f"{E}/{layout.benchmark('profile')}"
    shell:
        "{params.py} -m evident.workflow.stages.profile --checkpoint {input.ckpt} --evidence {params.ev} 2>&1 | tee {log}"
