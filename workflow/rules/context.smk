# The campaign's resolved config and the environment it runs in (env.json: devices, packages, versions).
rule context:
    output:
        config=f"{E}/{layout.CONFIG}",
        env=f"{E}/{layout.ENV}",
    # env.json records the devices the campaign runs on: it holds as many as its largest job
    resources:
        **job_resources(gpu=CAMPAIGN_GPUS),
    params:
        py=on_gpus(CAMPAIGN_GPUS),
        ev=evidence_dir,
        # a function: an `engines:` template's {placeholders} are not wildcards
        config=lambda wildcards: CONFIG_JSON,
    log:
        f"{E}/{layout.log('context')}",
    benchmark:
        f"{E}/{layout.benchmark('context')}"
    shell:
        "{params.py} -m evident.workflow.stages.context --evidence {params.ev} --config-json {params.config:q} 2>&1 | tee {log}"
