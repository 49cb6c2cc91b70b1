"""tools/device_decode.py's knobs (the decode probe runs on a GPU; its settings' bookkeeping is tested here)."""
import importlib.util
from pathlib import Path

import pytest

from kernels import mla, moe

TOOL = Path(__file__).resolve().parents[1] / "tools/device_decode.py"


def _tool():
    spec = importlib.util.spec_from_file_location("device_decode", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_knobs_hold_inside_and_are_put_back_even_when_set_twice_or_on_error():
    tool, splits, block_n = _tool(), mla.SPLITS, moe.BLOCK_N
    with tool.knobs_set(f"mla.SPLITS={splits + 1},mla.SPLITS={splits + 2},moe.BLOCK_N={block_n + 1}"):
        assert (mla.SPLITS, moe.BLOCK_N) == (splits + 2, block_n + 1)
    assert (mla.SPLITS, moe.BLOCK_N) == (splits, block_n)
    with pytest.raises(AttributeError), tool.knobs_set(f"mla.SPLITS={splits + 1},mla.NO_SUCH_CONSTANT=1"):
        pass
    assert mla.SPLITS == splits
