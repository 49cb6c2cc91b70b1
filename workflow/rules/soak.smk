# The soak: each soak target's server (`engine`, the builtin engine's, and `openai` entries of `engines:`) kept busy
# in turn, in one job; its gate file is what seal asks for.

SOAK_TARGETS = [TARGETS.get(t) or {"name": t, "kind": targets.BUILTIN} for t in targets.soak_targets(config)]
SOAK_GPUS = 1 if any("url" not in s for s in SOAK_TARGETS) else 0  # a server started here holds the GPU


rule soak:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
        env=rules.context.output.env,
    output:
        gate=f"{E}/{layout.SOAK_GATE}",
        targets=[f"{E}/{layout.soak_record(s['name'])}" for s in SOAK_TARGETS],
    # a load run: its latency windows want no other job beside it (bench.smk says how)
    threads: ALONE
    resources:
        **job_resources(gpu=SOAK_GPUS),
    params:
        py=on_gpus(SOAK_GPUS),
        ev=evidence_dir,
        specs=lambda wildcards: shlex.quote(json.dumps(SOAK_TARGETS)),  # a function: its braces are not wildcards
    log:
        f"{E}/{layout.log('soak')}",
    benchmark:
        f"{E}/{layout.benchmark('soak')}"
    shell:
        "{params.py} -m evident.workflow.stages.soak --checkpoint {input.ckpt} --evidence {params.ev} "
        "--specs {params.specs} 2>&1 | tee {log}"
