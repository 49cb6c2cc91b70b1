# The Hugging Face transformers oracle: greedy traces with per-step logit margins.


rule oracle:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
    output:
        f"{E}/{layout.ORACLE}",
    resources:
        **job_resources(gpu=1),
    params:
        py=on_gpus(1),
        ev=evidence_dir,
    log:
        f"{E}/{layout.log('oracle')}",
    benchmark:
        f"{E}/{layout.benchmark('oracle')}"
    shell:
        "{params.py} -m evident.workflow.stages.oracle --checkpoint {input.ckpt} --evidence {params.ev} 2>&1 | tee {log}"
