"""kernels/norm.py against the engine's RMSNorm (itself HF's numerics), on fresh random inputs; on the CPU
through Triton's interpreter at small ragged widths, on a GPU at the DeepSeek-V2-Lite widths."""
import pytest
import torch

from evident.engine.model import RMSNorm
from evident.kernels import norm

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
WIDTHS = [2048, 512, 1536] if CUDA else [96, 37, 512]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def module(D, dtype):
    m = RMSNorm(D, eps=1e-6).to(DEV)
    with torch.no_grad():
        m.weight.copy_(torch.randn(D, device=DEV) * 0.5 + 1)
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", WIDTHS)
def test_norms_match_the_engine_rmsnorm(D, dtype):
    m = module(D, dtype)
    x, delta = (torch.randn(3, D, device=DEV) * 4).to(dtype), torch.randn(3, D, device=DEV).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(norm.rms_norm(x, m.weight, m.eps), m(x), rtol=TOL[dtype], atol=TOL[dtype])
        h, y = norm.add_rms_norm(x, delta, m.weight, m.eps)
        if CUDA or dtype != torch.bfloat16:
            assert torch.equal(h, x + delta)  # the residual sum, rounded once, as torch's add
        else:  # the interpreter's numpy casts to bfloat16 by truncation, not to nearest: one unit in the last place
            torch.testing.assert_close(h, x + delta, rtol=2**-7, atol=0)
        torch.testing.assert_close(y, m(x + delta), rtol=TOL[dtype], atol=TOL[dtype])
        assert norm.norm_reason(x, m.weight) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_rms_norm_gathers_each_tokens_row_then_normalises(dtype):
    """h is the table's rows of the tokens, exactly (a repeated token, the last row, rows out of order); y is what
    rms_norm makes of h, bitwise (the same kernel's arithmetic)."""
    D = WIDTHS[1]
    m = module(D, dtype)
    table = (torch.randn(50, D, device=DEV) * 4).to(dtype)
    tokens = torch.tensor([49, 3, 3, 0, 17], device=DEV)
    with torch.no_grad():
        h, y = norm.embed_rms_norm(tokens, table, m.weight, m.eps)
        assert torch.equal(h, table[tokens])
        assert torch.equal(y, norm.rms_norm(table[tokens], m.weight, m.eps))
        torch.testing.assert_close(y, m(table[tokens]), rtol=TOL[dtype], atol=TOL[dtype])
        apart = norm.embed_rms_norm(tokens.int(), table, m.weight, m.eps)  # int32 tokens: the torch path
        assert torch.equal(apart[0], h) and torch.equal(apart[1], y)
    with pytest.raises(ValueError, match="tokens"):
        norm.embed_rms_norm(tokens[None], table, m.weight, m.eps)


def test_inadmissible_inputs_take_the_torch_path_and_shapes_are_errors():
    m = module(64, torch.float32)
    x = torch.randn(4, 128, device=DEV)[:, ::2]  # not contiguous
    assert "contiguous" in norm.norm_reason(x, m.weight)
    with torch.no_grad():
        torch.testing.assert_close(norm.rms_norm(x, m.weight, m.eps), m(x))
        h, y = norm.add_rms_norm(x, x, m.weight, m.eps)
        torch.testing.assert_close(y, m(x + x))
    with pytest.raises(ValueError, match="expected x"):
        norm.rms_norm(torch.randn(2, 65, device=DEV), m.weight, m.eps)
    with pytest.raises(ValueError, match="differ in shape"):
        norm.add_rms_norm(torch.randn(2, 64, device=DEV), torch.randn(1, 64, device=DEV), m.weight, m.eps)


# A bf16 sum of two roundings: on a GPU one unit in the last place (fp32 sum order); the interpreter truncates
# its casts, so there a few units of the operands' scale (x is ~4).
BF16_SUM = {"rtol": 2**-7, "atol": 0} if CUDA else {"rtol": 2**-6, "atol": 0.1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp32_delta_is_rounded_to_the_model_dtype_before_the_add(dtype):
    D = WIDTHS[1]
    m = module(D, dtype)
    x, delta = (torch.randn(2, D, device=DEV) * 4).to(dtype), torch.randn(2, D, device=DEV) / 3
    with torch.no_grad():
        h, y = norm.add_rms_norm(x, delta, m.weight, m.eps)
        want = x + delta.to(dtype)
        torch.testing.assert_close(h, want, **BF16_SUM if dtype == torch.bfloat16 else {"rtol": 0, "atol": 0})
        torch.testing.assert_close(y, m(want), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_add_rms_norm_sums_weighted_slots_then_adds_and_normalises(dtype):
    D, S = WIDTHS[1], 5
    m = module(D, dtype)
    x = (torch.randn(3, D, device=DEV) * 4).to(dtype)
    y, w = torch.randn(3, S, D, device=DEV), torch.rand(3, S, device=DEV) + 0.1
    delta = sum(w[:, s, None] * y[:, s] for s in range(S))  # the combine, written independently
    with torch.no_grad():
        h, out = norm.moe_add_rms_norm(x, y, w, m.weight, m.eps)
        torch.testing.assert_close(h, x + delta.to(dtype), **BF16_SUM if dtype == torch.bfloat16 else {})
        torch.testing.assert_close(out, m(h), rtol=TOL[dtype], atol=TOL[dtype])
        # the torch path (a non-contiguous y) gives the same answer
        h2, out2 = norm.moe_add_rms_norm(x, y.transpose(0, 1).contiguous().transpose(0, 1), w, m.weight, m.eps)
        torch.testing.assert_close(h2, h, **BF16_SUM if dtype == torch.bfloat16 else {})
    with pytest.raises(ValueError, match="slot weights"):
        norm.moe_add_rms_norm(x, y, w[:, :2], m.weight, m.eps)
