"""tools/device_decode.py's settings (the decode probe runs on a GPU; the bookkeeping of its knobs and
--cache-len is tested here)."""
import importlib.util
from pathlib import Path

import pytest

from evident.kernels import mla, moe

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


def test_cache_len_gives_every_cache_of_generate_at_least_that_many_positions_and_is_put_back():
    """--cache-len: the caches ``generate``'s rows decode in hold at least N positions a row inside the block (never
    fewer than the run needs), and the run's own length again after it; 0 changes nothing."""
    import torch

    from evident.engine.config import ModelArgs
    from evident.engine.generate import Rows
    from evident.engine.model import Transformer
    from test_engine_kernels import MICRO

    tool, model = _tool(), Transformer(ModelArgs.from_hf(MICRO)).eval()
    with torch.inference_mode():
        with tool.cache_at_least(64):
            assert Rows(model, 1, 5).cache.max_len == 64
            assert Rows(model, 2, 100).cache.max_len == 100
        assert Rows(model, 1, 5).cache.max_len == 5
        with tool.cache_at_least(0):
            assert Rows(model, 1, 5).cache.max_len == 5


def test_carveout_knobs_hold_inside_are_put_back_and_must_name_a_kernel_and_a_percent():
    """``carveout.module.kernel=percent`` beside the constants: in force inside the block only, and refused before
    anything runs for a value outside 0-100 or a name that is no @triton.jit kernel."""
    from evident.kernels import gemv

    tool, splits = _tool(), mla.SPLITS
    with tool.knobs_set(f"mla.SPLITS={splits + 1},carveout.gemv._rows_kernel=30,carveout.mla._q_latent_kernel=0"):
        assert tool.CARVEOUTS == {gemv._rows_kernel: 30, mla._q_latent_kernel: 0} and mla.SPLITS == splits + 1
    assert tool.CARVEOUTS == {} and mla.SPLITS == splits
    for bad in ("carveout.gemv._rows_kernel=101", "carveout.gemv._rows_kernel=-1", "carveout.gemv.MAX_K=30"):
        with pytest.raises(ValueError, match="a carveout is a percent"), tool.knobs_set(bad):
            pass
    with pytest.raises(AttributeError), tool.knobs_set("carveout.gemv._no_such_kernel=30"):
        pass
    assert tool.CARVEOUTS == {}


@pytest.mark.parametrize("mode", ["--ep", "--knockout"])
@pytest.mark.parametrize("setting", [["--cache-len", "2048"], ["--knobs", "mla.SPLITS=2"], ["--pdl", "off"],
                                     ["--projections", "triton"], ["--profile"]])
def test_a_setting_the_mode_does_not_read_is_refused_before_the_model_is_built(mode, setting, monkeypatch, capsys):
    """--ep and --knockout run their own step, so a setting only the timed variants read is an error naming it, before
    anything is built (it was silently ignored: a figure taken "at 2048 positions" that never was)."""
    tool = _tool()
    monkeypatch.setattr(tool, "build", lambda *a, **k: pytest.fail("built before the settings were checked"))
    with pytest.raises(SystemExit) as exit_:
        tool.main([mode, *setting])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{setting[0]} not read with {mode}" in err


def test_ep_and_knockout_together_are_refused_and_the_modes_own_settings_pass_the_check(monkeypatch):
    tool = _tool()
    with pytest.raises(SystemExit):
        tool.main(["--ep", "--knockout"])

    class Built(Exception):
        pass

    def build(layers, *rest):
        raise Built(layers)

    monkeypatch.setattr(tool, "build", build)
    with pytest.raises(Built) as built:
        tool.main(["--knockout", "--layers", "2", "--tokens", "4"])
    assert built.value.args == (2,)


def test_the_knockout_leaves_out_every_attention_core_mla_has():
    """--knockout's "mla attention core" replaces each core by name: a renamed or added core would run on."""
    names = {n for n in dir(mla) if n.startswith("_latent_attention")}
    assert names == set(_tool().CORES)
