"""A small, self-contained DeepSeek-V2 inference engine (gpt-fast style).

config.py      ModelArgs: the model shape, read from an HF config.json
model.py       Transformer (MLA attention over a compressed latent KV cache, MoE) and LatentCache
checkpoint.py  load_model(): HF-format safetensors -> Transformer; CheckpointError
generate.py    greedy batched generation: generate() -> Generation
decode_kernels.py  the `triton` decode path: projections and the greedy pick through kernels/ (Triton)
graph_decode.py    the `graph` decode path: one CUDA-graph-captured step (MLA, router, experts, norms in kernels/)
parallel.py    expert parallelism over torchrun ranks: ExpertParallel (host-staged | collective combine),
               init_from_env()

Only torch, safetensors and the standard library are used here, and kernels/ (Triton) on the triton path.
"""
