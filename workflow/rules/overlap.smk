# Overlap A/B screens: the built-in one (split GEMVs on the main stream vs the fused GEMV on a side stream beside a
# GEMM) and the campaign's own (`screens:`). Bitwise on fresh inputs everywhere (the Triton interpreter on the CPU);
# CUDA graph timings on a GPU.
OWN_SCREENS = [f"{E}/{path}" for e in config["screens"] for path in screens.files(e["name"]).values()]


rule overlap:
    input:
        # a model whose family screens its own layer (families.Family.own_layer) needs its weights: only then is the
        # checkpoint an input
        ckpt=[CKPT] if families.of(config["checkpoint"].get("config") or {}).own_layer else [],
        config=rules.context.output.config,
    output:
        **{kind: f"{E}/{path}" for kind, path in screens.files(screens.BUILTIN).items()},
        own=OWN_SCREENS + ([f"{E}/{layout.SCREENS}"] if OWN_SCREENS else []),
    # A timing run takes all cores, so no other job runs beside it; on the CPU it only compares bits.
    threads: ALONE if USES_GPU else 1
    resources:
        **job_resources(gpu=1),
    params:
        py=on_gpus(1),
        ev=evidence_dir,
        weights=lambda wildcards, input: f"--checkpoint {input.ckpt}" if input.ckpt else "",
    log:
        f"{E}/{layout.log('overlap')}",
    benchmark:
        f"{E}/{layout.benchmark('overlap')}"
    shell:
        "{params.py} -m evident.workflow.stages.overlap {params.weights} --evidence {params.ev} 2>&1 | tee {log}"
