"""Unit tests for workflow/models/checkpoints.py: the synthetic writer, its tokenizer, transformers
loading, describe()/verify() corruption checks and the offline hub fetch."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from evident.workflow.models import checkpoints
from evident.workflow.models.checkpoints import CheckpointInvalid

ROOT = Path(__file__).resolve().parents[1]
SEED, INIT_STD, DTYPE = 0, 0.08, "float32"


@pytest.fixture(scope="module")
def tiny_config() -> dict:
    """The default campaign's tiny DeepSeek-V2 config (vocab 512)."""
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["checkpoint"]["config"]
    assert cfg["vocab_size"] == 512
    return cfg


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, tiny_config) -> Path:
    return checkpoints.write_synthetic(tmp_path_factory.mktemp("syn") / "a", tiny_config, SEED, INIT_STD, DTYPE)


@pytest.fixture
def ckpt(synthetic, tmp_path) -> Path:
    """A private copy of the synthetic checkpoint that a test may corrupt."""
    return Path(shutil.copytree(synthetic, tmp_path / "ckpt"))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# --- synthetic writer ------------------------------------------------------------------------


def test_synthetic_files(synthetic, tiny_config):
    assert sorted(p.name for p in synthetic.iterdir()) == [
        "config.json", "evident_synthetic.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]
    meta = json.loads((synthetic / "evident_synthetic.json").read_text())
    assert meta["init_device"] == "cpu" and meta["dtype"] == DTYPE
    cfg = json.loads((synthetic / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v2"
    assert cfg["torch_dtype"] == DTYPE
    for k, v in tiny_config.items():
        assert cfg[k] == v, k
    tensors = load_file(synthetic / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert tensors["model.embed_tokens.weight"].shape == (512, 64)
    # Per-expert names of the original checkpoints, not transformers' packed tensors.
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in tensors
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in tensors)
    assert torch.equal(tensors["model.norm.weight"], torch.ones(64))
    std = tensors["model.embed_tokens.weight"].std().item()
    assert 0.06 < std < 0.10  # init_std is applied


def test_synthetic_byte_identical(synthetic, tiny_config, tmp_path):
    again = checkpoints.write_synthetic(tmp_path / "b", tiny_config, SEED, INIT_STD, DTYPE)
    a, b = _files(synthetic), _files(again)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], f"{name} differs between two writes with the same seed"


def test_synthetic_other_seed_differs(synthetic, tiny_config, tmp_path):
    other = checkpoints.write_synthetic(tmp_path / "c", tiny_config, SEED + 1, INIT_STD, DTYPE)
    a, b = _files(synthetic), _files(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert len(a["model.safetensors"]) == len(b["model.safetensors"])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert a[name] == b[name]  # the seed only moves the weights


def test_sharded_write_holds_the_same_weights_and_reports_each_shard(synthetic, tiny_config, tmp_path, monkeypatch):
    """Shards are drawn and written one at a time, in name order: the weights do not depend on the sharding (a
    cached checkpoint stays valid), and each shard written is a progress line with the bytes so far."""
    monkeypatch.setattr(checkpoints, "MAX_SHARD_BYTES", 200_000)
    lines: list[str] = []
    sharded = checkpoints.write_synthetic(tmp_path / "s", tiny_config, SEED, INIT_STD, DTYPE, progress=lines.append)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    one = load_file(synthetic / "model.safetensors")
    many = {k: v for s in shards for k, v in load_file(sharded / s).items()}
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in one.values())
    total = f"{index['metadata']['total_size'] / 1e6:.1f} MB"
    assert [line.split(":")[0] for line in lines] == [f"wrote {s}" for s in shards]
    assert lines[-1].startswith(f"wrote {shards[-1]}: {total} of {total} (100%), ")
    assert {k: v for k, v in _files(sharded).items() if not k.endswith("safetensors") and "index" not in k} == \
        {k: v for k, v in _files(synthetic).items() if not k.endswith("safetensors")}


def test_a_slow_shard_reports_while_it_is_drawn(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints, "PROGRESS_SECONDS", 0.0)
    lines: list[str] = []
    checkpoints.write_synthetic(tmp_path / "p", tiny_config, SEED, INIT_STD, DTYPE, progress=lines.append)
    assert lines[0].startswith("drawing model.safetensors: ") and " of 1.0 MB (" in lines[0]
    assert lines[-1].startswith("wrote model.safetensors: 1.0 MB of 1.0 MB (100%)")


def test_the_campaign_check_builds_the_tokenizer_without_torch():
    """workflow.checkpoints imports torch only when a function needs it (DTYPES included)."""
    import subprocess
    import sys

    code = ("import sys; from evident.workflow.models import checkpoints; checkpoints.build_tokenizer(512, 0, 1); "
            "assert 'torch' not in sys.modules; assert checkpoints.DTYPES['bfloat16'] is __import__('torch').bfloat16")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_build_tokenizer_rejects_bad_ids():
    with pytest.raises(CheckpointInvalid):
        checkpoints.build_tokenizer(512, 3, 3)
    with pytest.raises(CheckpointInvalid):
        checkpoints.build_tokenizer(512, 0, 512)
    with pytest.raises(CheckpointInvalid):
        checkpoints.build_tokenizer(257, 0, 1)


# --- tokenizer and transformers loading ---------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(synthetic):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(synthetic)


@pytest.mark.parametrize("text", [
    "Hello, evident! The engine says",
    "Question: what is 12 + 30?\nAnswer:",
    "def fibonacci(n):\n    return n  # tabs\tand  spaces ",
    "naïve café ✓",
    "日本語 🙂 Ωμέγα",
])
def test_tokenizer_round_trip(tokenizer, tiny_config, text):
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tiny_config["bos_token_id"] == tokenizer.bos_token_id
    assert tiny_config["bos_token_id"] not in ids[1:]
    assert all(0 <= i < tiny_config["vocab_size"] for i in ids)
    assert tokenizer.decode(ids[1:], skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


def _gpt2_byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode (what the ByteLevel pre-tokenizer maps each byte to), written out
    independently of workflow.checkpoints: printable bytes map to themselves, the rest to 256 + k."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def test_tokenizer_covers_every_id(tokenizer, tiny_config):
    n = tiny_config["vocab_size"]
    assert len(tokenizer) == n
    assert sorted(tokenizer.get_vocab().values()) == list(range(n))
    assert tokenizer.eos_token_id == tiny_config["eos_token_id"]
    # Every id decodes to its own bytes: a byte-level token is GPT-2 alphabet characters, one per byte,
    # and decoding it gives those bytes as UTF-8 (a lone continuation byte shows as U+FFFD).
    byte_of = {c: b for b, c in enumerate(_gpt2_byte_alphabet())}
    specials = {tiny_config["bos_token_id"], tiny_config["eos_token_id"]}
    for i in range(n):
        s = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        token = tokenizer.convert_ids_to_tokens(i)
        if i in specials:
            assert s == token, i
        else:
            assert s and s == bytes(byte_of[c] for c in token).decode("utf-8", errors="replace"), (i, token, s)
    assert tokenizer.decode([tiny_config["bos_token_id"]], skip_special_tokens=False) == tokenizer.bos_token
    assert tokenizer.decode(list(range(n)), skip_special_tokens=False)


def test_transformers_loads_synthetic_cleanly(synthetic):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(synthetic, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info.get("mismatched_keys"), info.get("mismatched_keys")
    # The weights come from the file, not a silent random init.
    tensors = load_file(synthetic / "model.safetensors")
    sd = model.state_dict()
    assert torch.equal(sd["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(sd["lm_head.weight"], tensors["lm_head.weight"])


@pytest.mark.parametrize("family", [
    {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
    {"model_type": "deepseek_v3", "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
     "routed_scaling_factor": 2.5, "rope_interleave": False}], ids=["v2-group-limited", "v3"])
def test_a_synthetic_checkpoint_of_each_family_is_transformers_own_and_the_engine_s(tiny_config, tmp_path, family):
    """The writer builds the family's transformers class (V3: its score correction bias is a checkpoint tensor,
    drawn like the weights); transformers and the engine load it cleanly and agree on the logits."""
    from transformers import AutoModelForCausalLM

    from evident.engine.checkpoint import load_model
    from evident.engine.model import LatentCache

    out = checkpoints.write_synthetic(tmp_path / "f", {**tiny_config, **family}, SEED, INIT_STD, DTYPE)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    v3 = family.get("model_type") == "deepseek_v3"
    assert type(model).__name__ == ("DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    names = set(load_file(out / "model.safetensors"))
    assert ("model.layers.1.mlp.gate.e_score_correction_bias" in names) == v3
    engine = load_model(out)
    assert engine.args.routing == ("noaux_tc" if v3 else "group_limited_greedy")
    ids = torch.tensor([[5, 17, 200, 33, 9, 71, 140, 2, 88]])
    with torch.inference_mode():
        ref = model(ids).logits
        got = engine(ids, LatentCache.for_model(engine, max_rows=1, max_len=ids.shape[1]))
    assert (got - ref).abs().max() < 1e-4


def test_mtp_layers_in_a_v3_checkpoint_are_named_and_neither_side_reads_them(tiny_config, tmp_path):
    """A V3 checkpoint holding its multi-token-prediction layers (numbered after the model's own): the record names
    them (engine.checkpoint.mtp_tensors), and the oracle's loader (workflow/models/hf.py) and the engine load the model
    without them, with the same logits as the checkpoint without them."""
    import json

    from safetensors.torch import save_file

    from evident.engine.checkpoint import load_model, mtp_tensors
    from evident.workflow.models import hf

    v3 = {**tiny_config, "model_type": "deepseek_v3", "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1}
    out = checkpoints.write_synthetic(tmp_path / "v3", v3, SEED, INIT_STD, DTYPE)
    ids = torch.tensor([[5, 17, 200, 33, 9]])
    _, plain = hf.load(out, "float32", "cpu")
    tensors = load_file(out / "model.safetensors")
    layers = v3["num_hidden_layers"]
    mtp = {k.replace("model.layers.1.", f"model.layers.{layers}.", 1): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.1.")}
    save_file({**tensors, **mtp}, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert mtp_tensors(out) == []  # without num_mtp_layers they are no MTP layers: the engine refuses them
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_mtp_layers": 1}))
    assert mtp_tensors(out) == sorted(mtp)
    _, loaded = hf.load(out, "float32", "cpu")
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, plain(ids).logits)
        assert len(load_model(out).layers) == layers


# --- describe / verify -------------------------------------------------------------------


def test_describe_valid(ckpt):
    files = checkpoints.describe(ckpt)
    assert set(files) == {p.name for p in ckpt.iterdir()}
    for name, f in files.items():
        data = (ckpt / name).read_bytes()
        assert f == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    checkpoints.verify(ckpt, {"files": files})  # an untouched copy verifies


def test_describe_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointInvalid, match=r"config\.json"):
        checkpoints.describe(ckpt)


def test_describe_missing_dir(tmp_path):
    with pytest.raises(CheckpointInvalid, match="nope"):
        checkpoints.describe(tmp_path / "nope")


def test_describe_no_safetensors(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointInvalid, match=r"\.safetensors"):
        checkpoints.describe(ckpt)


def test_describe_truncated(ckpt):
    w = ckpt / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointInvalid, match=r"model\.safetensors"):
        checkpoints.describe(ckpt)


def test_describe_truncated_by_one_byte(ckpt):
    w = ckpt / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-1])
    with pytest.raises(CheckpointInvalid, match=r"model\.safetensors"):
        checkpoints.describe(ckpt)


def test_describe_corrupt_header(ckpt):
    w = ckpt / "model.safetensors"
    data = bytearray(w.read_bytes())
    assert data[8:9] == b"{"  # the JSON header starts after the 8-byte length
    data[8] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointInvalid, match=r"model\.safetensors"):
        checkpoints.describe(ckpt)


def test_describe_expected_sha_mismatch(ckpt):
    files = checkpoints.describe(ckpt)
    assert checkpoints.describe(ckpt, {"tokenizer.json": files["tokenizer.json"]["sha256"]}) == files
    with pytest.raises(CheckpointInvalid, match=r"tokenizer\.json") as e:
        checkpoints.describe(ckpt, {"tokenizer.json": "0" * 64})
    assert "0" * 64 in str(e.value)


def test_describe_expected_file_missing(ckpt):
    with pytest.raises(CheckpointInvalid, match=r"special_tokens_map\.json"):
        checkpoints.describe(ckpt, {"special_tokens_map.json": "0" * 64})


def test_describe_index_points_at_missing_shard(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointInvalid, match=r"model-00002-of-00002\.safetensors"):
        checkpoints.describe(ckpt)


def test_verify_catches_changed_tensor_byte(synthetic, ckpt):
    record = {"files": checkpoints.describe(synthetic)}
    w = ckpt / "model.safetensors"
    data = bytearray(w.read_bytes())
    (header_len,) = struct.unpack("<Q", bytes(data[:8]))
    start = 8 + header_len
    pos = start + (len(data) - start) // 3  # inside the tensor data, not the last tensor
    data[pos] ^= 0x01
    w.write_bytes(bytes(data))
    assert len(data) == record["files"]["model.safetensors"]["size"]
    # The file is still structurally valid: only the sha256 comparison can catch it.
    assert checkpoints.describe(ckpt)["model.safetensors"]["size"] == len(data)
    with pytest.raises(CheckpointInvalid, match=r"model\.safetensors"):
        checkpoints.verify(ckpt, record)


def test_verify_catches_changed_config(synthetic, ckpt):
    record = {"files": checkpoints.describe(synthetic)}
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointInvalid, match=r"config\.json"):
        checkpoints.verify(ckpt, record)


# --- hub fetch (offline, pre-populated cache) --------------------------------------------

REPO_ID = "evident-org/tiny-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_offline(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 and an empty HF cache under tmp_path.

    huggingface_hub reads both variables once at import (huggingface_hub.constants), so the
    constants are patched as well as the environment.
    """
    from huggingface_hub import constants

    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert constants.is_offline_mode()
    return cache


def _populate_cache(cache: Path, repo_id: str, commit: str, files: dict[str, bytes]) -> Path:
    """The huggingface_hub cache layout: blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs, refs/main."""
    from huggingface_hub.file_download import repo_folder_name

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    assert storage.name == "models--" + repo_id.replace("/", "--")
    (storage / "blobs").mkdir(parents=True)
    snap = storage / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (storage / "blobs" / blob).write_bytes(data)
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / blob)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)  # no newline, as huggingface_hub writes it
    return snap


@pytest.fixture
def hub_files(tmp_path) -> dict[str, bytes]:
    w = tmp_path / "w.safetensors"
    save_file({"lm_head.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(w), metadata={"format": "pt"})
    return {
        "config.json": b'{"model_type": "deepseek_v2"}\n',
        "model.safetensors": w.read_bytes(),
        "tokenizer.json": b'{"version": "1.0"}\n',
    }


@pytest.mark.parametrize("revision", [COMMIT, "main"])
def test_fetch_hub_offline_from_cache(hf_offline, hub_files, tmp_path, revision):
    snap = _populate_cache(hf_offline, REPO_ID, COMMIT, hub_files)
    out = checkpoints.fetch_hub(tmp_path / "out", REPO_ID, revision)
    assert out == tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(hub_files)
    for name, data in hub_files.items():
        assert (out / name).read_bytes() == data
        assert (out / name).resolve() == (snap / name).resolve()  # linked, not copied
    files = checkpoints.describe(out)  # the fetched directory is a valid checkpoint
    assert files["model.safetensors"]["sha256"] == hashlib.sha256(hub_files["model.safetensors"]).hexdigest()


def test_fetch_hub_offline_empty_cache(hf_offline, tmp_path):
    with pytest.raises(CheckpointInvalid) as e:
        checkpoints.fetch_hub(tmp_path / "out", REPO_ID, COMMIT)
    msg = str(e.value).lower()
    assert "offline" in msg and "cache" in msg
    assert REPO_ID in str(e.value)


def test_fetch_hub_offline_other_revision_not_cached(hf_offline, hub_files, tmp_path):
    _populate_cache(hf_offline, REPO_ID, COMMIT, hub_files)
    with pytest.raises(CheckpointInvalid, match="cache"):
        checkpoints.fetch_hub(tmp_path / "out", REPO_ID, "f" * 40)
