"""The trained checkpoint source: the problem generator's held-out split, the trainer's determinism, the files it
writes (transformers and the engine load them cleanly), and the campaign checks of `checkpoint.train`."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from evident.workflow.models import arithmetic, checkpoints, training
from evident.workflow.parity import gsm8k
from evident.workflow.plan.campaign import model_config

REPO = Path(__file__).resolve().parents[1]
TINY = model_config("tiny")
# a few steps of short rows: determinism and the file layout, not learning (the default campaign shows that)
SHORT = {"steps": 4, "batch_size": 2, "seq_len": 64, "lr": 0.01, "warmup": 2, "threads": 2}


def _hashes(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return training.train(tmp_path_factory.mktemp("t") / "a", TINY, 0, 0.02, "float32", SHORT)


# --- the generator ------------------------------------------------------------------------------

def test_held_out_questions_are_never_training_questions():
    test = arithmetic.problems(0, "test", 64)
    train = {p["question"] for p in arithmetic.problems(0, "train", 20000, distinct=False)}
    assert len({p["question"] for p in test}) == 64  # distinct
    assert not train & {p["question"] for p in test}
    assert all(arithmetic.split_of(p["question"]) == "test" for p in test)
    # another seed draws other held-out questions, still of the test split
    other = arithmetic.problems(1, "test", 64)
    assert [p["question"] for p in other] != [p["question"] for p in test]
    assert all(arithmetic.split_of(p["question"]) == "test" for p in other)


def test_answers_are_right_and_in_the_gsm8k_format():
    for p in arithmetic.problems(3, "train", 200):
        a, op, b, _, c = p["answer"].split("\n")[0].split()
        assert int(c) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] >= 1
        assert str(a) in p["question"] and str(b) in p["question"]
        assert gsm8k.gold(p["answer"]) == c


def test_generated_source_records_its_data_and_holds_out_the_test_split():
    cfg = {"source": "generated", "seed": 0}
    test, meta = gsm8k.load_split(cfg, "test")
    train, _ = gsm8k.load_split(cfg, "train")
    assert (len(test), len(train)) == (gsm8k.GENERATED_ROWS["test"], gsm8k.GENERATED_ROWS["train"])
    assert meta["source"] == "generated" and meta["rows"] == len(test) and len(meta["sha256"]) == 64
    assert gsm8k.load_split(cfg, "test")[1] == meta  # the same bytes every time
    assert {arithmetic.split_of(r["question"]) for r in test} == {"test"}
    assert {arithmetic.split_of(r["question"]) for r in train} == {"train"}


def test_training_rows_take_the_loss_on_answers_and_the_stop_string_only():
    tok, _, _ = checkpoints.build_tokenizer(TINY["vocab_size"], 0, 1)
    x, y = next(training.rows(tok, 0, 1, 128, 0))
    assert x.shape == y.shape == (1, 128) and x[0, 0] == 0
    kept = tok.decode([int(t) for t in y[0] if t != -100])
    assert "Question:" in kept and "####" in kept and " = " in kept
    assert not any(name in kept for name in arithmetic.NAMES)  # question bodies are not learnt
    kept_at = (y[0, :-1] != -100).nonzero().flatten()
    assert len(kept_at) and torch.equal(y[0, kept_at], x[0, kept_at + 1])  # a label is the next input token


# --- the trainer ----------------------------------------------------------------------------------

def test_same_seed_config_and_steps_give_byte_identical_files(trained, tmp_path):
    again = training.train(tmp_path / "b", TINY, 0, 0.02, "float32", SHORT)
    assert _hashes(again) == _hashes(trained)
    meta = json.loads((trained / "evident_trained.json").read_text())
    assert meta["train"] == SHORT and meta["seed"] == 0 and meta["loss"]["last"] < meta["loss"]["first"]


def test_another_seed_or_step_count_gives_other_weights(trained, tmp_path):
    seed = training.train(tmp_path / "s", TINY, 1, 0.02, "float32", SHORT)
    steps = training.train(tmp_path / "n", TINY, 0, 0.02, "float32", {**SHORT, "steps": 5})
    for other in (seed, steps):
        assert _hashes(other)["model.safetensors"] != _hashes(trained)["model.safetensors"]


def test_the_progress_line_says_the_time_left_from_the_mean_step_so_far(tmp_path, monkeypatch):
    """Each line as training prints it: step, loss, seconds so far and, until the last step, the time left (the
    mean step so far times the steps left). A clock of one second a reading makes the seconds exact."""
    import re
    import types

    ticks = iter(range(10_000))
    monkeypatch.setattr(training, "time", types.SimpleNamespace(monotonic=lambda: float(next(ticks))))
    monkeypatch.setattr(training, "PROGRESS_SECONDS", 0.0)  # a line every step
    lines = []
    training.train(tmp_path / "p", TINY, 0, 0.02, "float32", SHORT, progress=lines.append)
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == SHORT["steps"], lines
    for line in steps[:-1]:
        m = re.fullmatch(r"step (\d+)/(\d+): loss \d+\.\d{4}, (\d+)s, about (\d+)s left", line)
        assert m, line
        done, total, elapsed, left = map(int, m.groups())
        assert elapsed > 0 and left == round(elapsed / done * (total - done)), line
    assert re.fullmatch(rf"step {SHORT['steps']}/{SHORT['steps']}: loss \d+\.\d{{4}}, \d+s", steps[-1]), steps[-1]
    # past a minute, minutes and seconds
    assert training.progress_line(54, 800, 0.5625, 87.2) == "step 54/800: loss 0.5625, 87s, about 20m05s left"


def test_padded_values_train_as_transformers_sdpa_does(tmp_path):
    """training.PADDED_SDPA (the values zero-padded to the queries' head size, for torch's CPU flash kernel) gives
    transformers' own sdpa loss and gradients: the padding attends to zeros and is cut off."""
    from transformers import AttentionInterface

    ckpt = checkpoints.write_synthetic(tmp_path / "init", TINY, 0, 0.02, "float32")
    _, cls = checkpoints.hf_classes(checkpoints.family(TINY))
    AttentionInterface.register(training.PADDED_SDPA, training.padded_sdpa)
    x = torch.randint(2, TINY["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    grads = {}
    for attention in ("sdpa", training.PADDED_SDPA):
        model = cls.from_pretrained(ckpt, dtype=torch.float32, attn_implementation=attention)
        logits = model(input_ids=x).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        grads[attention] = (logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (a, ga), (b, gb) = grads.values()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys() and any("self_attn" in n for n in ga)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-6, msg=name)


def test_trained_files_load_cleanly_in_transformers_and_the_engine(trained):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from evident.engine.checkpoint import load_model

    model, info = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    written = load_file(trained / "model.safetensors")
    assert sorted(written) == sorted(checkpoints.parameter_shapes(checkpoints.full_config(TINY, "float32")))
    # the packed expert tensor transformers trained is the per-expert tensors written, gate first
    packed = model.model.layers[1].mlp.experts.gate_up_proj
    half = packed.shape[1] // 2
    assert torch.equal(packed[3, :half], written["model.layers.1.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(packed[3, half:], written["model.layers.1.mlp.experts.3.up_proj.weight"])
    engine = load_model(trained, device="cpu", dtype=torch.float32)
    assert engine is not None


def test_bf16_checkpoint_is_the_float32_training_rounded(trained, tmp_path):
    from safetensors.torch import load_file

    bf16 = training.train(tmp_path / "h", TINY, 0, 0.02, "bfloat16", SHORT)
    a, b = load_file(trained / "model.safetensors"), load_file(bf16 / "model.safetensors")
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"


# --- campaign checks ------------------------------------------------------------------------------

def _campaign(**checkpoint) -> dict:
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["checkpoint"] = {**copy.deepcopy(cfg["checkpoint"]), **checkpoint}
    return cfg


def _problems(cfg: dict) -> str:
    from snakemake.exceptions import WorkflowError

    from evident.workflow.plan.campaign import validate_campaign

    try:
        validate_campaign(cfg, str(REPO / "config/schema.yaml"))
    except WorkflowError as e:
        return str(e)
    return ""


def test_train_defaults_fill_in_for_trained_and_are_refused_for_other_sources():
    cfg = _campaign(train={"steps": 7})
    assert _problems(cfg) == ""
    assert cfg["checkpoint"]["train"] == {"steps": 7, "batch_size": 16, "seq_len": 256, "lr": 0.006, "warmup": 20,
                                          "threads": 2}
    bare = _campaign()
    del bare["checkpoint"]["train"]
    assert _problems(bare) == "" and bare["checkpoint"]["train"]["steps"] == 800
    msg = _problems(_campaign(source="synthetic"))
    assert "`checkpoint.train`: only for source trained, not synthetic" in msg, msg


def test_rows_longer_than_the_context_are_refused_before_work():
    msg = _problems(_campaign(train={"seq_len": 512}))
    assert "`checkpoint.train.seq_len`: 512 tokens a row exceed the model's context of 256" in msg, msg


def test_another_trainer_version_is_another_cache_entry(monkeypatch):
    """A trainer that trains other weights from the same spec (training.VERSION) never reuses the old cache entry;
    a synthetic checkpoint's entry does not depend on it."""
    from evident.workflow.plan import estimate

    trained = {"checkpoint": {"source": "trained", "seed": 0, "init_std": 0.02, "train": SHORT, "config": TINY},
               "dtype": "float32", "device": "cpu"}
    synthetic = {**trained, "checkpoint": {k: v for k, v in trained["checkpoint"].items() if k != "train"}
                 | {"source": "synthetic"}}
    before = estimate.cache_dir(trained), estimate.cache_dir(synthetic)
    monkeypatch.setattr(training, "VERSION", training.VERSION + 1)
    assert estimate.cache_dir(trained) != before[0] and estimate.cache_dir(synthetic) == before[1]
