# The benchmark over HTTP, one job per target (`engine`, the builtin engine through its own server, and `openai`
# entries of `engines:`): a cell per concurrency and prompt contract, and a cell per rate of the rate rung with the
# target's rate plot; bench_report.smk puts the builtin engine's concurrency cells beside its in-process cells.
rule serve_bench:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
        env=rules.context.output.env,
    output:
        [f"{E}/{layout.bench_cell(runs.http_cell('{target}', c, p))}" for p in runs.bench_contracts(config["bench"])
         for c in config["bench"]["http"]["concurrency"]],
        [f"{E}/{layout.bench_cell(runs.rate_cell('{target}', r))}" for r in config["bench"]["http"]["rates"]],
    wildcard_constraints:
        target="|".join(map(re.escape, HTTP_TARGETS)) or "(?!)",
    # a timing run: no other job beside it (bench.smk says how); a server started here holds the GPU
    threads: ALONE
    resources:
        **job_resources(gpu=http_gpus),
    params:
        py=lambda wildcards: on_gpus(http_gpus(wildcards)),
        ev=evidence_dir,
        spec=lambda wildcards: shlex.quote(json.dumps(HTTP_TARGETS[wildcards.target])),
    log:
        f"{E}/{layout.log('serve_bench-{target}')}",
    benchmark:
        f"{E}/{layout.benchmark('serve_bench-{target}')}"
    shell:
        "{params.py} -m evident.workflow.stages.serve_bench --checkpoint {input.ckpt} --evidence {params.ev} "
        "--spec {params.spec} 2>&1 | tee {log}"
