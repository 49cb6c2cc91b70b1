"""The hyper-connection weights kernel (kernels/hc.py) against transformers' own DeepseekV4HyperConnection on fresh
random inputs (through the Triton interpreter without a GPU), its fallbacks and shape errors, and its torch reference
against the engine's."""
import pytest
import torch

from evident.engine.deepseek_v4 import hyper_weights
from evident.kernels import hc

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture
def gen():
    g = torch.Generator(device=DEV)
    g.seed()
    return g


@pytest.mark.parametrize("n,iters", [(4, 20), (3, 5), (1, 1)])
def test_kernel_matches_transformers(n, iters, gen):
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    import transformers

    cfg = transformers.DeepseekV4Config(hidden_size=16, hc_mult=n, hc_sinkhorn_iters=iters)
    mod = modeling.DeepseekV4HyperConnection(cfg).to(DEV)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=DEV))
        h = torch.randn(3, 5, n, 16, generator=gen, device=DEV)
        post, comb, _ = mod(h)
        mix = torch.nn.functional.linear(mod.input_norm(h.flatten(2)), mod.fn)
        pre_k, post_k, comb_k = hc.hc_weights(mix, mod.base, mod.scale, n, iters, cfg.hc_eps)
    assert hc.hc_reason(mix, mod.base, mod.scale, n, iters) is None
    assert (post_k - post).abs().max() < 1e-5 and (comb_k - comb).abs().max() < 1e-5
    pre_r, _, comb_r = hc.hc_reference(mix, mod.base, mod.scale, n, iters, cfg.hc_eps)
    assert (pre_k - pre_r).abs().max() < 1e-5
    if n > 1:  # doubly stochastic up to eps: the check can see a skipped normalisation
        assert (comb_k.sum(-2) - 1).abs().max() < 1e-3
        wrong = hc.hc_reference(mix, mod.base, mod.scale, n, 1, cfg.hc_eps)[2]
        assert iters == 1 or (wrong - comb).abs().max() > 1e-4


def test_fallbacks_and_errors():
    mix, base, scale = torch.randn(2, 24), torch.randn(24), torch.ones(3)
    assert "fp32" in hc.hc_reason(mix.double(), base, scale, 4, 3)
    big = hc.MAX_N + 1
    assert "above" in hc.hc_reason(torch.randn(2, (2 + big) * big), torch.randn((2 + big) * big), scale, big, 3)
    with pytest.raises(ValueError, match="expected mix"):
        hc.hc_weights(mix, base[:5], scale, 4, 3, 1e-6)
    pre, post, comb = hc.hc_weights(mix.double(), base, scale, 4, 3, 1e-6)  # not admitted: the torch path
    want = hc.hc_reference(mix, base, scale, 4, 3, 1e-6)
    assert torch.equal(comb, want[2]) and comb.shape == (2, 4, 4)


@pytest.mark.parametrize("n,iters", [(4, 20), (3, 5), (1, 1)])
def test_reference_is_the_engines(n, iters, gen):
    """The kernel's torch reference and the engine's torch path are two copies (kernels import nothing of the
    engine): bitwise equal."""
    w = (2 + n) * n
    mix, base, scale = (torch.randn(*shape, generator=gen, device=DEV) for shape in ((3, 5, w), (w,), (3,)))
    for a, b in zip(hc.hc_reference(mix, base, scale, n, iters, 1e-6), hyper_weights(mix, base, scale, n, iters, 1e-6)):
        assert torch.equal(a, b)
