"""A small, self-contained inference engine of the DeepSeek family (gpt-fast style): DeepSeek-V2/V3 (MLA) and V4.

config.py      ModelArgs (V2/V3) and V4Args: the model shape, read from an HF config.json (load_args picks)
model.py       Transformer (MLA attention over a compressed latent KV cache, MoE) and LatentCache
deepseek_v4.py V4Transformer (sliding-window, compressed sparse and heavily compressed attention, hash and top-k
               MoE, hyper-connections) and its static V4Cache; v4_checkpoint.py: its checkpoint names
checkpoint.py  load_model(): HF-format safetensors -> Transformer; CheckpointError
generate.py    greedy batched generation: Rows (the decode loop; rows join between steps), generate() -> Generation
decode_kernels.py  the `triton` decode path: projections and the greedy pick through kernels/ (Triton)
graph_decode.py    the `graph` decode path: one CUDA-graph-captured step (MLA, router, experts, norms in kernels/);
               v4_graph.py: DeepSeek-V4's
parallel.py    expert parallelism over torchrun ranks: ExpertParallel (host-staged | collective combine),
               init_from_env()

Only torch, safetensors and the standard library are used here, and kernels/ (Triton) on the triton path.
"""
