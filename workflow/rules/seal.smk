# Sealing: SUMMARY.md, MLflow, MANIFEST.json last. Its own log lives outside the sealed directory.


rule seal:
    input:
        rules.context.output,
        rules.record_checkpoint.output,
        rules.oracle.output,
        rules.compare.output,
        rules.bench_report.output,
        rules.overlap.output.screen,
        rules.kernel_audit.output,
        rules.quality.output.gate,
        rules.profile.output.capture,
    output:
        summary=f"{E}/SUMMARY.md",
        manifest=f"{E}/MANIFEST.json",
    resources:
        **job_resources(),
    params:
        py=PY,
        ev=evidence_dir,
        commit=GIT["commit"] or "",
        dirty=GIT["dirty"] or "",
        tracking="--tracking-uri '{}'".format(config["tracking"]["uri"]) if config["tracking"]["uri"] else "",
        no_tracking="" if config["tracking"]["enabled"] else "--no-tracking",
    log:
        f"{SEAL_LOGS}/seal.log",
    benchmark:
        f"{SEAL_LOGS}/seal.benchmark.tsv"
    shell:
        "{params.py} -m workflow.stages.seal --evidence {params.ev} --commit '{params.commit}' --dirty '{params.dirty}' {params.tracking} {params.no_tracking} 2>&1 | tee {log}"
