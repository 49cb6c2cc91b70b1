"""kernels/hbm.py: the read the floors' bandwidth is measured with reads every byte, and a read that does not is
refused before it is timed (a kernel that skips bytes would report a bandwidth no read has)."""
import pytest
import torch

from evident.kernels import hbm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_block_sums_read_every_block():
    x = torch.randn(3 * hbm.BLOCK, device=DEVICE)
    out = torch.full((3,), float("nan"), device=DEVICE)
    hbm.block_sums(x, out)
    torch.testing.assert_close(out, x.view(3, hbm.BLOCK).sum(1), rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton read is timed on a GPU only")
def test_a_read_that_skips_bytes_is_refused(monkeypatch):
    assert hbm.read_bandwidth("cuda", mib=64, repeats=3) > 0
    monkeypatch.setattr(hbm, "block_sums", lambda x, out: out.zero_())
    with pytest.raises(RuntimeError, match="no read's"):
        hbm.read_bandwidth("cuda", mib=64, repeats=3)
