from evident.engine.config import V4

# Overlap A/B screens: the built-in one (split GEMVs on the main stream vs the fused GEMV on a side stream beside a
# GEMM) and the campaign's own (`screens:`). Bitwise on fresh inputs everywhere (the Triton interpreter on the CPU);
# CUDA graph timings on a GPU.
OWN_SCREENS = [f"{E}/{path}" for e in config["screens"] for path in screens.files(e["name"]).values()]


rule overlap:
    input:
        # a DeepSeek-V4 model's own C4 layer is screened with its weights: only then is the checkpoint an input
        ckpt=[CKPT] if (config["checkpoint"].get("config") or {}).get("model_type") == V4 else [],
        config=rules.context.output.config,
    output:
        screen=f"{E}/overlap/screen.json",
        timings=f"{E}/overlap/timings.csv",
        plot=f"{E}/plots/overlap.png",
        own=OWN_SCREENS + ([f"{E}/{screens.INDEX}"] if OWN_SCREENS else []),
    # A timing run takes all cores, so no other job runs beside it; on the CPU it only compares bits.
    threads: ALONE if USES_GPU else 1
    resources:
        **job_resources(gpu=1),
    params:
        py=on_gpus(1),
        ev=evidence_dir,
        weights=lambda wildcards, input: f"--checkpoint {input.ckpt}" if input.ckpt else "",
    log:
        f"{E}/logs/overlap.log",
    benchmark:
        f"{E}/logs/overlap.benchmark.tsv"
    shell:
        "{params.py} -m evident.workflow.stages.overlap {params.weights} --evidence {params.ev} 2>&1 | tee {log}"
