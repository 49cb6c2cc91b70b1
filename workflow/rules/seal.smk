# Sealing: SUMMARY.md, MLflow, MANIFEST.json last. Its own log lives outside the sealed directory.


rule seal:
    input:
        rules.context.output,
        rules.record_checkpoint.output,
        rules.oracle.output,
        rules.compare.output,
    output:
        summary=f"{E}/SUMMARY.md",
        manifest=f"{E}/MANIFEST.json",
    params:
        commit=GIT["commit"] or "",
        dirty=GIT["dirty"] or "",
    log:
        f"{SEAL_LOGS}/seal.log",
    benchmark:
        f"{SEAL_LOGS}/seal.benchmark.tsv"
    shell:
        "{PY} -m workflow.stages.seal --evidence {E} --commit '{params.commit}' --dirty '{params.dirty}' 2>&1 | tee {log}"


rule gate:
    input:
        rules.seal.output.manifest,
    output:
        GATE,
    log:
        f"{SEAL_LOGS}/gate.log",
    benchmark:
        f"{SEAL_LOGS}/gate.benchmark.tsv"
    shell:
        "{PY} -m workflow.stages.gate --evidence {E} --out {output} 2>&1 | tee {log}"
