"""Triton kernels of the engine, each with a torch reference, an admission predicate and a contract.

gemv.py    gemv_exact, gemv_fused, gemm_per_token: one deterministic row kernel, bitwise contracts
skinny.py  skinny_linear: projections of 2-16 rows on the tensor cores (the graph decode step above batch 1)
argmax.py  pick_batch: greedy pick (lowest index on ties) and its margin, one launch
moe.py     experts_gate_up, experts_down, moe_experts: routed experts, each read once per call (moe_bench.py)
route.py   route, add_norm_route: the MoE router (fp32 logits, softmax, top-k, shared slots) in one launch,
           with the residual add and RMSNorm before it
mla.py     mla_cache_write, mla_attention, mla_decode: MLA decode in the latent space (norm, rope, cache write,
           attention)
norm.py    rms_norm, add_rms_norm, moe_add_rms_norm: the residual add (or the MoE sum) and RMSNorm in one launch
pdl.py     programmatic dependent launch: the launch flags and the wait every kernel of the decode step calls
audit.py   registers, spills and shared memory of each compiled kernel
bench.py   gemv_fused (or --skinny: skinny_linear) against F.linear on a GPU
graphs.py  capture: warm up on a side stream, capture one CUDA graph (benchmarks, overlap screen, graph decode)
overlap.py the A/B screens: the contract (Screen), the bitwise check and timing every screen runs through, and
           the built-in screen (c4_screen): split GEMVs on the main stream vs the fused GEMV on a side stream

The registry is kernels/KERNELS.md. Nothing here imports the rest of the project.
"""
