# Engine runs per backend (one job loops over the batch sizes), then the comparison against the oracle.


rule parity:
    input:
        ckpt=CKPT,
        record=rules.record_checkpoint.output,
    output:
        [f"{E}/parity/{{backend}}-b{b}.json" for b in config["parity"]["batch_sizes"]],
    wildcard_constraints:
        backend="single",
    params:
        batch_sizes=",".join(map(str, config["parity"]["batch_sizes"])),
    log:
        f"{E}/logs/parity-{{backend}}.log",
    benchmark:
        f"{E}/logs/parity-{{backend}}.benchmark.tsv"
    shell:
        "{PY} -m workflow.stages.parity --checkpoint {input.ckpt} --evidence {E} "
        "--backend {wildcards.backend} --batch-sizes {params.batch_sizes} 2>&1 | tee {log}"


rule compare:
    input:
        oracle=rules.oracle.output,
        runs=PARITY,
    output:
        f"{E}/parity/comparison.json",
    log:
        f"{E}/logs/compare.log",
    benchmark:
        f"{E}/logs/compare.benchmark.tsv"
    shell:
        "{PY} -m workflow.stages.compare --evidence {E} {input.runs} 2>&1 | tee {log}"
