"""HF-format checkpoint directories: the synthetic writer, hub fetch, hashing and verification.

A synthetic checkpoint is a seeded random init of the model's architecture (its family's: workflow/models/families/),
written with the names hub checkpoints use (the family's `saved_state`), a byte-level BPE tokenizer that
`AutoTokenizer` loads, and HF config files. Same seed, config and dtype give byte-identical files.

Init (`_init`): norm weights and DeepSeek-V4's hyper-connection scales are ones; V4's hash-routing tables
(`ffn.gate.tid2eid`, [vocab, top_k]) hold seeded expert ids, distinct within a row, written as int64 whatever the
campaign's dtype (`INTEGER`); everything else is N(0, init_std).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import time
from pathlib import Path
from typing import Callable

from safetensors import safe_open

from evident.engine.config import read_config
from evident.workflow.core.evidence import read_json, sha256_file, write_json, write_text
from evident.workflow.models import families

WEIGHT_SUFFIXES = (".safetensors",)
REQUIRED = ("config.json",)
MAX_SHARD_BYTES = 4 << 30
# Hashes of large files are reused while a file's size, mtime and inode are unchanged (as git's index
# does): a 31 GB checkpoint is hashed once, not by every stage that verifies it.
HASH_CACHE = Path(".evident/sha256")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROGRESS_SECONDS = 5.0
# Sources whose model is the campaign's checkpoint.config, written here (the others bring their config.json);
# of them only `synthetic` has random weights.
WRITTEN = ("synthetic", "trained")
RANDOM = "synthetic"


def __getattr__(name: str):
    """DTYPES (names to torch dtypes) imports torch on first use: the campaign check before any work builds the
    synthetic tokenizer from this module and should not pay for torch."""
    if name == "DTYPES":
        return {n: torch_dtype(n) for n in DTYPE_BYTES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class CheckpointInvalid(ValueError):
    """A checkpoint directory is missing a file, or a file is corrupt or not the expected one."""


# --- synthetic ------------------------------------------------------------------------------

# DeepSeek-V4's checkpoint tensors that are not floats: the hash layers' token -> experts table, int64 on disk
INTEGER = re.compile(r"(^|\.)gate\.tid2eid$")
# DeepSeek-V4's hyper-connection scales (hc_attn_scale, hc_ffn_scale, hc_head.hc_scale): ones, as norm weights
ONES = re.compile(r"(norm\.weight|(^|\.|_)hc_(attn_|ffn_|head_)?scale)$")


def family(hf_config: dict) -> str:
    """A config's model_type (families.model_type: the default family's where it names none)."""
    return families.model_type(hf_config)


def architecture(model_type: str) -> str:
    """transformers' native class of a model_type (its family's `architectures`)."""
    return families.of({"model_type": model_type}).architectures[model_type]


def hf_classes(model_type: str):
    """(config class, model class) of transformers for a model_type of a family (families.FAMILIES)."""
    import transformers

    name = architecture(model_type)
    return getattr(transformers, name.replace("ForCausalLM", "Config")), getattr(transformers, name)


def parameter_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes from the real transformers model built on the meta device (buffers included: a score
    correction bias or a hash-routing table is a checkpoint tensor), under the family's checkpoint names
    (`saved_state`)."""
    import torch

    model_type = family(hf_config)
    config_cls, model_cls = hf_classes(model_type)
    try:  # a copy: transformers rewrites the rope dict it is given in place (type -> rope_type)
        cfg = config_cls(**copy.deepcopy(hf_config))
    except (TypeError, ValueError) as e:
        raise CheckpointInvalid(f"checkpoint.config is not a valid {config_cls.__name__}: {e}") from e
    with torch.device("meta"):
        model = model_cls(cfg)
    return {name: tuple(t.shape) for name, t in saved_state(model, model_type, cfg.tie_word_embeddings).items()}


def saved_state(model, model_type: str, tied: bool) -> dict:
    """A transformers model's tensors under the names this module writes (a tied lm_head left out): its family's
    checkpoint names (families.Family.saved_state)."""
    return families.of({"model_type": model_type}).saved_state(model, tied)


def _init(name: str, shape: tuple[int, ...], std: float, gen, experts: int | None = None):
    """One tensor of the seeded init (module docstring); `experts`: n_routed_experts, for a tid2eid table."""
    import torch

    if ONES.search(name):
        return torch.ones(shape)
    if INTEGER.search(name):  # each row: top_k distinct experts, a seeded permutation's first k
        rows, k = shape
        keys = torch.rand((rows, experts), generator=gen, device=gen.device)
        return keys.argsort(dim=1, stable=True)[:, :k].to("cpu", torch.int64)
    return (torch.randn(shape, generator=gen, device=gen.device) * std).cpu()


def _itemsize(name: str, itemsize: int) -> int:
    """Bytes an element of a written tensor: the campaign dtype's, int64 for INTEGER tensors."""
    return 8 if INTEGER.search(name) else itemsize


def _bytes_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table (the ByteLevel pre-tokenizer's alphabet), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def build_tokenizer(vocab_size: int, bos_id: int, eos_id: int):
    """A byte-level BPE tokenizer covering exactly `vocab_size` ids, every id decodable.

    Merges are generated in a fixed order (frequent English characters first), so the file is
    deterministic; bos/eos sit at the config's ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = {bos_id: "<｜begin▁of▁sentence｜>", eos_id: "<｜end▁of▁sentence｜>"}
    if max(specials) >= vocab_size or len(specials) != 2:
        raise CheckpointInvalid(f"bos/eos ids {bos_id}/{eos_id} must differ and be < vocab_size {vocab_size}")
    alphabet = _bytes_alphabet()
    space = alphabet[ord(" ")]
    order = [space] + list("etaoinshrdlucmfwypvbgkjqxz") + [c for c in alphabet if c not in "etaoinshrdlucmfwypvbgkjqxz" + space]
    need = vocab_size - len(specials) - 256
    if need < 0:
        raise CheckpointInvalid(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (needs >= 258)")
    merges: list[tuple[str, str]] = []
    level = order
    while len(merges) < need:
        nxt = []
        for a in level:
            for b in order:
                if len(merges) == need:
                    break
                merges.append((a, b))
                nxt.append(a + b)
        level = nxt
    normal = alphabet + [a + b for a, b in merges]
    vocab, it = {}, iter(normal)
    for i in range(vocab_size):
        vocab[specials.get(i) or next(it)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.add_special_tokens(list(specials.values()))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    bos = specials[bos_id]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
    return tok, specials[bos_id], specials[eos_id]


def full_config(hf_config: dict, dtype: str) -> dict:
    """config.json of a checkpoint this module writes: the campaign's fields, the architecture and the dtype."""
    model_type = family(hf_config)
    cfg = {"architectures": [architecture(model_type)], "model_type": model_type, **hf_config}
    cfg.setdefault("bos_token_id", 0)
    cfg.setdefault("eos_token_id", 1)
    cfg["torch_dtype"] = dtype
    return cfg


def write_synthetic(out_dir: str | Path, hf_config: dict, seed: int, init_std: float, dtype: str,
                    init_device: str = "cpu", progress: Callable[[str], None] | None = None) -> Path:
    """Seeded init. `init_device: cuda` draws on the GPU (seconds instead of minutes for 15.7B
    parameters); the bytes are then reproducible on the same GPU model and torch version.

    Weights are drawn and written one shard at a time (in name order, so the bytes do not depend on the
    sharding): the writer holds one shard and its serialised copy, not the whole model. `progress` gets a
    line per shard written and, while a shard is drawn, one every PROGRESS_SECONDS.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = full_config(hf_config, dtype)
    shapes = sorted(parameter_shapes(cfg).items())
    gen = torch.Generator(device=init_device).manual_seed(seed)
    experts, dt = cfg.get("n_routed_experts"), torch_dtype(dtype)

    def draw(name, shape):
        t = _init(name, shape, init_std, gen, experts)
        return (t if INTEGER.search(name) else t.to(dt)).contiguous()

    _save_sharded(out, shapes, DTYPE_BYTES[dtype], draw, progress or (lambda line: None))
    write_json(out / "evident_synthetic.json", {"seed": seed, "init_std": init_std, "dtype": dtype,
                                                "init_device": init_device, "torch": torch.__version__})
    write_model_files(out, cfg)
    return out


def write_weights(out_dir: str | Path, tensors: dict, dtype: str, progress: Callable[[str], None] | None = None) -> None:
    """Named tensors (per-expert names) as the synthetic writer lays them out: name order, same shards (INTEGER
    tensors stay int64)."""
    import torch

    dt = torch_dtype(dtype)
    _save_sharded(Path(out_dir), sorted((n, tuple(t.shape)) for n, t in tensors.items()), DTYPE_BYTES[dtype],
                  lambda name, shape: tensors[name].detach().to("cpu", torch.int64 if INTEGER.search(name) else dt)
                  .contiguous(), progress or (lambda line: None))


def write_model_files(out: Path, cfg: dict) -> None:
    """config.json, generation_config.json and the byte-level tokenizer, beside the weights."""
    write_json(out / "config.json", dict(sorted(cfg.items())))
    write_json(out / "generation_config.json", {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False})
    tok, bos, eos = build_tokenizer(cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    write_text(out / "tokenizer.json", tok.to_str(pretty=True) + "\n")
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "add_bos_token": True, "model_max_length": cfg.get("max_position_embeddings", 2048),
        "clean_up_tokenization_spaces": False,
    })


def shard_plan(sizes: list[tuple[str, int]]) -> list[list[str]]:
    """Names in order, cut into shards of at most MAX_SHARD_BYTES (a larger tensor is a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, n in sizes:
        if shards[-1] and size + n > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _save_sharded(out: Path, shapes: list[tuple[str, tuple[int, ...]]], itemsize: int, draw, progress) -> None:
    from safetensors.torch import save_file

    nbytes = {name: _itemsize(name, itemsize) * math.prod(shape) for name, shape in shapes}
    shape_of = dict(shapes)
    plan = shard_plan(list(nbytes.items()))
    total, done, t0 = sum(nbytes.values()), 0, time.monotonic()
    names = ["model.safetensors"] if len(plan) == 1 else [f"model-{i:05d}-of-{len(plan):05d}.safetensors"
                                                          for i in range(1, len(plan) + 1)]
    for fname, shard in zip(names, plan):
        tensors, drawn, last = {}, 0, time.monotonic()
        for name in shard:
            tensors[name] = draw(name, shape_of[name])
            drawn += nbytes[name]
            if time.monotonic() - last >= PROGRESS_SECONDS:
                last = time.monotonic()
                progress(f"drawing {fname}: {_gb(done + drawn)} of {_gb(total)} ({(done + drawn) / total:.0%}), "
                         f"{last - t0:.0f}s")
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        done += sum(nbytes[n] for n in shard)
        del tensors
        progress(f"wrote {fname}: {_gb(done)} of {_gb(total)} ({done / total:.0%}), {time.monotonic() - t0:.0f}s")
    if len(plan) > 1:
        weight_map = {name: fname for fname, shard in zip(names, plan) for name in shard}
        write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


# --- hub ------------------------------------------------------------------------------------

def fetch_hub(out_dir: str | Path, repo_id: str, revision: str) -> Path:
    """snapshot_download at a pinned commit (the HF cache and HF_HUB_OFFLINE are honoured), then
    link the snapshot's files into `out_dir` so every campaign sees one plain directory."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snap = Path(snapshot_download(repo_id, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except LocalEntryNotFoundError as e:
        raise CheckpointInvalid(
            f"{repo_id}@{revision} is not in the local Hugging Face cache and the hub cannot be reached "
            f"(offline mode or no network): download it once with network access, or use checkpoint.source: local"
        ) from e
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(snap.iterdir()):
        if f.is_file():
            (out / f.name).unlink(missing_ok=True)
            (out / f.name).symlink_to(f.resolve())
    return out


# --- hashing and verification ---------------------------------------------------------------

def describe(ckpt_dir: str | Path, expected: dict[str, str] | None = None) -> dict[str, dict]:
    """Per-file sha256 and size; checks that the directory is a loadable checkpoint first.

    Raises CheckpointInvalid naming the file when a required file is missing, a safetensors file
    is truncated or corrupt, a sharded index points at a missing file, or an expected hash differs.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointInvalid(f"checkpoint directory {root} does not exist")
    for name in REQUIRED:
        if not (root / name).is_file():
            raise CheckpointInvalid(f"checkpoint file {root / name} is missing")
    weights = sorted(p for p in root.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise CheckpointInvalid(f"no *.safetensors file in {root}")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        for fname in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            if not (root / fname).is_file():
                raise CheckpointInvalid(f"checkpoint file {root / fname} (listed in {index.name}) is missing")
    for w in weights:
        try:
            with safe_open(str(w), framework="pt") as f:
                keys = list(f.keys())
                if keys:  # reading the last tensor catches a truncated file
                    f.get_slice(keys[-1])[...]
        except Exception as e:  # safetensors raises several types for a bad header or data
            raise CheckpointInvalid(f"checkpoint file {w} is corrupt or truncated: {e}") from e
    files = {p.name: {"sha256": cached_sha256(p), "size": p.stat().st_size} for p in sorted(root.iterdir()) if p.is_file()}
    for name, want in (expected or {}).items():
        if name not in files:
            raise CheckpointInvalid(f"checkpoint file {root / name} is missing (an expected sha256 is configured for it)")
        if files[name]["sha256"] != want:
            raise CheckpointInvalid(f"checkpoint file {root / name} has sha256 {files[name]['sha256']}, expected {want}")
    return files


def check_prompts(ckpt_dir: str | Path, config: dict) -> None:
    """Each case's prompt plus its new tokens (and the bench prompt plus bench.new_tokens) must fit the
    model's context (config.json max_position_embeddings), counted with the checkpoint's own tokenizer.
    The campaign check does the same before any work wherever the tokenizer exists then (synthetic, local)."""
    from tokenizers import Tokenizer

    root = Path(ckpt_dir)
    context = read_config(root).get("max_position_embeddings")
    if not isinstance(context, int) or not (root / "tokenizer.json").is_file():
        return
    for _, where, what in prompt_problems(Tokenizer.from_file(str(root / "tokenizer.json")), context, config):
        raise CheckpointInvalid(f"{where}: {what}")


def prompt_problems(tok, context: int, config: dict) -> list[tuple[str, str, str]]:
    """(key, case, what) for each prompt that encodes to nothing or does not fit the context with its new tokens."""
    items = [(f"cases.{i}.prompt", f"cases.{i} ({c['name']})", c["prompt"], c.get("max_new_tokens", 32))
             for i, c in enumerate(config.get("cases", []))]
    bench = config.get("bench") or {}
    if bench.get("prompt"):
        items.append(("bench.prompt", "bench", bench["prompt"], bench.get("new_tokens", 32)))
    items += [(f"bench.prompts.{i}", f"bench.prompts.{i}", p, bench.get("new_tokens", 32))
              for i, p in enumerate(bench.get("prompts") or [])]
    out = []
    for key, where, prompt, new in items:
        n = len(tok.encode(prompt).ids)
        if n == 0:
            out.append((key, where, "the prompt encodes to no tokens"))
        elif n + new > context:
            out.append((key, where, f"the prompt is {n} tokens and {new} new tokens are asked: more than "
                                    f"the model's context of {context} tokens (max_position_embeddings)"))
    return out


def cached_sha256(path: Path) -> str:
    st = path.stat()
    if st.st_size < (64 << 20):
        return sha256_file(path)
    # one small file per path: concurrent stages never lose each other's entries
    entry = HASH_CACHE / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]}.json"
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    try:
        cached = read_json(entry)
        if cached["stamp"] == stamp:
            return cached["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(path)
    write_json(entry, {"stamp": stamp, "sha256": digest})
    return digest


def verify(ckpt_dir: str | Path, record: dict) -> None:
    """Check a checkpoint directory against the files recorded in checkpoint.json."""
    describe(ckpt_dir, {name: f["sha256"] for name, f in record["files"].items()})
