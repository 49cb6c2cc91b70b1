"""The engine's Triton decode path (engine/decode_kernels.py) against the real transformers DeepseekV2.

On the CPU the kernels run through Triton's interpreter (~20 ms a launch), so the model is micro; on a
GPU the same test runs compiled in bf16. Checks: greedy tokens equal HF's, logits within fp32 tolerance,
the kernels actually ran (counted), batched rows equal to batch 1, and the fused weights stay views (no
copy of the model).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_engine_parity import hf_generate, hf_model  # noqa: E402

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import evident.kernels  # noqa: E402
from evident.engine import decode_kernels  # noqa: E402
from evident.engine.checkpoint import load_model  # noqa: E402
from evident.engine.generate import _prefill, generate  # noqa: E402
from evident.engine.model import LatentCache, MoE  # noqa: E402
from evident.kernels import gemv, moe  # noqa: E402

MICRO = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=16,
             q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
             first_k_dense_replace=1, initializer_range=0.1, max_position_embeddings=64, bos_token_id=1,
             eos_token_id=2)
PROMPT = [17, 50, 3, 91, 45]
TOL = 1e-4  # fp32 logits against transformers (tests/test_engine_parity.py's)
RAGGED = [[17, 50, 3, 91, 45, 8, 60, 33, 12], PROMPT, [9, 8, 7, 6, 5, 4, 3]]  # 3 rows of 9: 27 > gemv.MAX_M tokens
N_NEW = 4
CUDA = torch.cuda.is_available()


def micro_models(tmp_path_factory, enable):
    """(HF's micro model, the engine on its checkpoint, a second engine with a decode path enabled)."""
    hf = hf_model(MICRO)
    ckpt = tmp_path_factory.mktemp("micro")
    hf.save_pretrained(ckpt)
    device = "cuda" if CUDA else "cpu"
    return hf, load_model(ckpt, device=device), enable(load_model(ckpt, device=device))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return micro_models(tmp_path_factory, decode_kernels.enable)


def test_kernel_path_greedy_equals_hf(models, monkeypatch):
    hf, plain, fast = models
    calls = {"rows": 0, "fused": 0}
    for name, fn in (("rows", "gemm_per_token"), ("fused", "gemv_fused")):
        real = getattr(gemv, fn)
        monkeypatch.setattr(gemv, fn, lambda *a, _real=real, _n=name, **k: (calls.__setitem__(_n, calls[_n] + 1),
                                                                           _real(*a, **k))[1])
    # enable() looks the kernels up when it runs: enabling the plain model now routes it through the counters
    want = hf_generate(hf, PROMPT, N_NEW)
    got = generate(decode_kernels.enable(plain), [PROMPT], N_NEW)
    assert got.tokens[0] == want
    assert calls["rows"] > 0 and calls["fused"] > 0, calls


def test_kernel_path_logits_close_to_torch_path(models, tmp_path):
    hf, _, fast = models
    ids = torch.tensor([PROMPT], device=fast.embed_tokens.weight.device)
    cache = LatentCache.for_model(fast, max_rows=1, max_len=len(PROMPT) + 1)
    with torch.inference_mode():
        fast(ids, cache)
        step = fast(ids[:, -1:], cache)[0, -1].double().cpu()
        ref = hf(torch.tensor([PROMPT + PROMPT[-1:]])).logits[0, -1].double()
    assert (step - ref).abs().max().item() < 1e-4


def test_kernel_path_batch_rows_bitwise_equal_batch1(models):
    _, _, fast = models
    one = generate(fast, [PROMPT], N_NEW)
    many = generate(fast, [PROMPT] * 2, N_NEW)
    assert all(row == one.tokens[0] for row in many.tokens)
    # projections are row-exact (tests/test_kernels.py); attention over the batch is torch's, so the
    # logits agree to rounding, not to the bit
    assert all(m == pytest.approx(one.margins[0], rel=1e-4, abs=1e-5) for m in many.margins)


def test_fused_weights_are_views(models):
    _, _, fast = models
    attn = fast.layers[0].self_attn
    q, kv = attn.q_in.weight, attn.kv_a_proj_with_mqa.weight
    assert q.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    assert attn.pair_kernel is not None and fast.layers[0].mlp.pair_kernel is not None


def test_batched_projections_take_the_few_row_kernel(models):
    """With ``batched`` (the graph decode step's setting) one row takes the GEMV kernels, 2-16 rows the
    tensor-core kernels.skinny (the q + kv_a pair as one call), more the torch path."""
    from evident.kernels import skinny

    _, plain, _ = models
    decode_kernels.enable(plain, max_rows=1, batched=True)
    attn, mlp = plain.layers[0].self_attn, plain.layers[0].mlp
    g = torch.Generator(device=attn.q_in.weight.device).manual_seed(0)
    x = torch.randn(4, attn.q_in.weight.shape[1], generator=g, device=g.device)
    q, kv = attn.pair_kernel(x)
    sizes = [attn.q_in.weight.shape[0], attn.kv_a_proj_with_mqa.weight.shape[0]]
    want = skinny.skinny_linear(x, torch.cat([attn.q_in.weight, attn.kv_a_proj_with_mqa.weight]), sizes)
    assert torch.equal(q, want[0]) and torch.equal(kv, want[1])
    h = torch.randn(3, mlp.down_proj.weight.shape[1], generator=g, device=g.device)
    assert torch.equal(mlp.down_proj(h), skinny.skinny_linear(h, mlp.down_proj.weight))
    assert torch.equal(mlp.down_proj(h[:1]), gemv.gemm_per_token(h[:1], mlp.down_proj.weight))
    wide = torch.randn(skinny.MAX_M + 1, h.shape[1], generator=g, device=g.device)
    assert torch.equal(mlp.down_proj(wide), torch.nn.functional.linear(wide, mlp.down_proj.weight))
    assert attn.pair_kernel(torch.randn(skinny.MAX_M + 1, x.shape[1], generator=g, device=g.device)) is None


def test_the_cpu_kernels_refuse_to_run_without_the_interpreter_switch_set_at_start(monkeypatch):
    """Set inside the process, the switch comes after torch imported Triton: nested kernels then fail deep in
    Triton. The stage says what to do instead (the rules set it for every CPU stage)."""
    from evident.workflow.plan import environment

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as conftest sets it on a CPU (on a GPU it is unset)
    environment.require_interpreter("x")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="the engine's triton decode path on a CPU runs Triton's interpreter: set "
                                           "TRITON_INTERPRET=1 in the environment before Python starts"):
        environment.require_interpreter("the engine's triton decode path")


def prefill_logits(model, prompts) -> list[torch.Tensor]:
    """Each row's logits [len, vocab] (fp64, host) of generate's one batched prefill of the ragged prompts."""
    with torch.inference_mode():
        cache = model.new_cache(len(prompts), max(map(len, prompts)))
        return [t.double().cpu() for t in _prefill(model, cache, prompts, list(range(len(prompts))))]


def worst_against_hf(hf, model, prompts) -> float:
    """The largest |logit - HF's| of a ragged batch's prefill, each row against its prompt alone in transformers."""
    with torch.no_grad():
        return max((got - hf(torch.tensor([p])).logits[0].double()).abs().max().item()
                   for got, p in zip(prefill_logits(model, prompts), prompts))


@pytest.fixture(scope="module")
def micro_checkpoint(tmp_path_factory):
    from test_engine_parity import hf_model

    hf, ckpt = hf_model(MICRO), tmp_path_factory.mktemp("micro-prefill")
    hf.save_pretrained(ckpt)
    return hf, ckpt


def test_a_prefill_takes_the_grouped_experts_kernel(micro_checkpoint, monkeypatch):
    """A ragged batch's prefill (more tokens than gemv.MAX_M) runs each MoE layer's routed experts in one
    kernels.moe call, not the per-expert loop, and keeps parity: each row's logits HF's for its prompt alone, and
    the torch path's, within fp32 rounding."""
    hf, ckpt = micro_checkpoint
    device = "cuda" if CUDA else "cpu"
    plain, fast = load_model(ckpt, device=device), decode_kernels.enable(load_model(ckpt, device=device))
    calls, real = [], moe.moe_experts
    monkeypatch.setattr(moe, "moe_experts", lambda x, *a, **k: (calls.append(x.shape[0]), real(x, *a, **k))[1])
    worst = worst_against_hf(hf, fast, RAGGED)
    print(f"prefill through the kernel: max |logit - HF| {worst:.3g}")  # pytest -s: the figure
    assert calls == [len(RAGGED) * 9] * sum(isinstance(layer.mlp, MoE) for layer in fast.layers)
    assert worst < TOL
    torch_path = prefill_logits(plain, RAGGED)
    assert all((a - b).abs().max() < TOL for a, b in zip(prefill_logits(fast, RAGGED), torch_path))
    calls.clear()
    generate(fast, [PROMPT], 1)  # 5 tokens: the loop's row kernels, bitwise as a decode step's
    assert calls == []


WRONG_EXPERT = ("    w_e = w + e * ((2 * N if GATED else N) * K)\n",
                "    w_e = w + (e ^ 1) * ((2 * N if GATED else N) * K)  # injected: the next expert's weights\n")


def test_a_wrong_expert_in_the_prefill_kernel_fails_parity(micro_checkpoint, tmp_path, monkeypatch):
    """An injected bug in a scratch copy of kernels/moe.py: the tensor-core kernel (a prefill's) reads expert e ^ 1's
    weights for expert e. The ragged batch's prefill then leaves HF's logits for each prompt alone far behind."""
    hf, ckpt = micro_checkpoint
    source = (Path(moe.__file__)).read_text()
    head, dot = source.split("def _dot_kernel", 1)
    assert dot.count(WRONG_EXPERT[0]) == 1 and head.count(WRONG_EXPERT[0]) == 1  # the row kernel's stays
    file = tmp_path / "moe_wrong_expert.py"  # Triton reads a kernel's source from its file
    file.write_text(head + "def _dot_kernel" + dot.replace(*WRONG_EXPERT))
    spec = importlib.util.spec_from_file_location("evident.kernels.moe_wrong_expert", file)
    mutant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutant)
    monkeypatch.setattr(evident.kernels, "moe", mutant)  # what decode_kernels.experts_kernel imports
    fast = decode_kernels.enable(load_model(ckpt, device="cuda" if CUDA else "cpu"))
    worst = worst_against_hf(hf, fast, RAGGED)
    print(f"wrong expert in the prefill kernel: max |logit - HF| {worst:.3g}")  # pytest -s: the figure
    assert worst > 100 * TOL
