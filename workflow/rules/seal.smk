# Sealing: SUMMARY.md and DETAILS.md, MLflow, MANIFEST.json last. Its own log lives outside the sealed directory.


# What each stage of `stages:` leaves for sealing (its last rule's output); a stage the campaign does not run has
# no job at all.
STAGE_OUTPUTS = {
    "oracle": rules.oracle.output,
    "parity": rules.compare.output,
    "bench": rules.bench_report.output,
    "serve_bench": rules.bench_report.output,  # the HTTP cells are reported, and set beside the in-process ones, there
    "soak": rules.soak.output.gate,
    "overlap": rules.overlap.output.screen,
    "kernel_audit": rules.kernel_audit.output,
    "quality": rules.quality.output.gate,
    "profile": rules.profile.output.capture,
}


rule seal:
    input:
        rules.context.output,
        rules.record_checkpoint.output,
        [STAGE_OUTPUTS[s] for s in config["stages"]],
    output:
        summary=f"{E}/{layout.SUMMARY}",
        details=f"{E}/{layout.DETAILS}",
        manifest=f"{E}/{layout.MANIFEST}",
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
        "{params.py} -m evident.workflow.stages.seal --evidence {params.ev} --commit '{params.commit}' --dirty '{params.dirty}' {params.tracking} {params.no_tracking} 2>&1 | tee {log}"
