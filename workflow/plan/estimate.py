"""What a campaign needs, known before any work: the model's size against this machine, prompts against its context.

Size. P parameters (counted from the model's config, the tensors transformers builds, buffers in the checkpoint
included: the family's `parameters`, workflow/models/families/; tests check the counts against
checkpoints.parameter_shapes; a local checkpoint: its safetensors headers), s bytes a parameter in the
campaign's dtype (float32 4, bfloat16 and float16 2), shard = checkpoints.MAX_SHARD_BYTES (4 GiB):

    weights      = P * s
    disk         = P * s                      the synthetic checkpoint (nothing when it is cached already)
    write        = 2 * min(P * s, shard)      the synthetic writer holds one shard and its serialised copy
    peak memory  = max(P * 4, write)          the oracle and parity stages hold a float32 copy of the model
                                              (a bf16 or fp16 campaign frees its own copy first)
    train        = P * 16                     a trained checkpoint: float32 weights, gradients and AdamW's two
                                              moments, on the campaign's device (activations on top)

On device cpu the peak is host memory. On cuda it is GPU memory (parity's float32 run holds the whole model on one
device), and host memory holds the write only. Weights only: activations, the KV cache and the runtime (~1 GB) come
on top, and jobs run side by side (-c N) add up; a campaign beyond host memory (the cgroup limit where lower), GPU
memory (the smallest visible GPU, device cuda) or the free disk under .evident/checkpoints is refused, unless
EVIDENT_ALLOW_LARGE=1.

Tokens. The quality defaults are fitted to the data and the model (schema: quality.gsm8k.limit, shots, max_tokens),
and explicit values checked, with the checkpoint's tokenizer wherever it exists before any work: a synthetic
checkpoint's is built from its config (the same one the writer writes), a local one's is read.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path

from safetensors import SafetensorError, safe_open

from evident.engine.config import read_config
from evident.workflow.core.evidence import config_hash
from evident.workflow.models import checkpoints, families
from evident.workflow.parity import gsm8k

ALLOW = "EVIDENT_ALLOW_LARGE"
CACHE = Path(".evident/checkpoints")
LIMIT, SHOTS, MAX_TOKENS = 64, 5, 256  # the harness's GSM8K-64 contract, the defaults where they fit
TRAIN_BYTES = 16
MAX_VOCAB = 1 << 20  # above it the synthetic tokenizer is not built before work (its merges grow with the vocabulary)


# --- size -----------------------------------------------------------------------------------------

def parameters(hf_config: dict) -> int:
    """Parameters of the config's transformers model (unset fields take the config class's defaults): its family's
    count (families.Family.parameters) of the engine's reading."""
    family = families.of(hf_config)
    return family.parameters(family.args(hf_config))


def local_parameters(path: str | Path) -> int | None:
    """Elements of every tensor in a checkpoint directory's safetensors, read from their headers (numpy framework:
    no torch, no tensor data); None when unreadable (the checkpoint record names what is wrong)."""
    total = 0
    try:
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), framework="numpy") as fh:
                total += sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return None
    return total or None


@dataclasses.dataclass
class Need:
    params: int
    dtype: str
    weights: int
    disk: int
    write: int
    peak: int
    train: int = 0

    def line(self) -> str:
        return (f"{count(self.params)} parameters; weights {gb(self.weights)} ({self.dtype}); checkpoint "
                f"{gb(self.disk)} on disk; peak memory {gb(self.peak)} (" +
                ("training: float32 weights, gradients and AdamW's moments" if self.peak == self.train else
                 "the float32 copy of the oracle and parity stages" if self.peak == self.params * 4 else
                 "the synthetic writer's shard and its serialised copy") + ")")


def need(params: int, dtype: str, trained: bool = False) -> Need:
    weights = params * checkpoints.DTYPE_BYTES[dtype]
    write = 2 * min(weights, checkpoints.MAX_SHARD_BYTES)
    train = TRAIN_BYTES * params if trained else 0
    return Need(params, dtype, weights, weights, write, max(params * 4, write, train), train)


def count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def gb(n: int) -> str:
    return f"{n / 1e12:.1f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def host_memory() -> int:
    """Physical memory, or the cgroup's limit where lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            total = min(total, int(Path(f).read_text().strip()))
        except (OSError, ValueError):  # absent, or "max"
            pass
    return total


def gpu_memory() -> int | None:
    """The smallest visible GPU's memory; None without nvidia-smi."""
    from evident.workflow.plan import gpus

    return gpus.smallest_memory()


def free_disk(path: Path) -> int:
    p = path.absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def cache_dir(config: dict) -> Path:
    """The checkpoint cache directory of a synthetic, trained or hub campaign."""
    from evident.workflow.models import training

    spec = config["checkpoint"]
    keyed = {"checkpoint": spec, "dtype": config["dtype"], "device": config["device"]}
    if spec["source"] == "trained":
        keyed["trainer"] = training.VERSION
    return CACHE / f"{spec['source']}-{config_hash(keyed)[:12]}"


def checkpoint_dir(config: dict) -> Path:
    """A campaign's checkpoint: a local one used in place (never a rule's output, so Snakemake never deletes it);
    synthetic, trained and hub ones in the cache keyed by their spec (relative to the repository)."""
    spec = config["checkpoint"]
    return Path(spec["path"]) if spec["source"] == "local" else cache_dir(config)


def campaign_need(config: dict, model: dict | None) -> Need | None:
    spec = config["checkpoint"]
    if spec["source"] in checkpoints.WRITTEN and model is not None:
        return need(parameters(model), config["dtype"], trained=spec["source"] == "trained")
    if spec["source"] == "local":
        params = local_parameters(spec["path"])
        if params:
            return dataclasses.replace(need(params, config["dtype"]), disk=0)  # in place: nothing is written
    return None  # hub: the size comes with the download


def size_problems(config: dict, model: dict | None) -> list[tuple[str, str]]:
    """The estimate against this machine (module docstring), as (key, message); none with EVIDENT_ALLOW_LARGE=1."""
    n = campaign_need(config, model)
    if n is None or os.environ.get(ALLOW):
        return []
    from evident.workflow.plan import gpus

    device = config["device"]
    if device == "auto":
        device = "cuda" if gpus.visible() else "cpu"
    over = []
    if device == "cuda":
        gpu = None if os.environ.get("EVIDENT_SKIP_DEVICE_CHECK") else gpu_memory()
        if gpu is not None and n.train > gpu:
            over.append(f"training ({gb(n.train)}: float32 weights, gradients and AdamW's moments) exceeds GPU memory "
                        f"({gb(gpu)})")
        elif gpu is not None and n.params * 4 > gpu:
            over.append(f"the float32 copy ({gb(n.params * 4)}) exceeds GPU memory ({gb(gpu)})")
        host_need, what = n.write, "the synthetic write"
    else:
        host_need, what = n.peak, "peak memory"
    if host_need > (host := host_memory()):
        over.append(f"{what} ({gb(host_need)}) exceeds host memory ({gb(host)})")
    if n.disk and config["checkpoint"]["source"] in checkpoints.WRITTEN and not cache_dir(config).is_dir():
        if n.disk > (free := free_disk(CACHE)):
            over.append(f"the checkpoint ({gb(n.disk)}) exceeds the free disk under {CACHE}/ ({gb(free)})")
    if not over:
        return []
    return [("checkpoint", f"the model does not fit this machine: {'; '.join(over)}. Estimate: {n.line()}. Make it "
                           f"smaller (e.g. checkpoint.base: tiny), or set {ALLOW}=1 to run it anyway")]


# --- tokens ---------------------------------------------------------------------------------------

def model_files(config: dict, model: dict | None):
    """(context, tokenizer) known before any work: synthetic and trained from their config, local from its files;
    else None."""
    spec = config["checkpoint"]
    if spec["source"] in checkpoints.WRITTEN and model is not None:
        tok = None
        if model["vocab_size"] <= MAX_VOCAB:
            tok, _, _ = checkpoints.build_tokenizer(model["vocab_size"], model.get("bos_token_id", 0),
                                                    model.get("eos_token_id", 1))
        return model["max_position_embeddings"], tok
    if spec["source"] == "local":
        from tokenizers import Tokenizer

        root = Path(spec["path"])
        try:
            context = read_config(root).get("max_position_embeddings")
            tok = Tokenizer.from_file(str(root / "tokenizer.json")) if (root / "tokenizer.json").is_file() else None
        except Exception:  # noqa: BLE001 - a damaged checkpoint: the checkpoint record names what is wrong
            return None, None
        return (context if isinstance(context, int) else None), tok
    return None, None


def fit_quality(config: dict, context: int | None, tok) -> list[tuple[str, str]]:
    """Fill quality.gsm8k's null limit, shots and max_tokens (schema descriptions) and check every value against the
    data's rows and the context; returns (key, message) problems."""
    g, key = config["quality"]["gsm8k"], "quality.gsm8k"
    if not {"hf", "engine"} & set(t for t in config["quality"]["targets"] if isinstance(t, str)):
        context = tok = None  # endpoints only: their models are not this campaign's
    rows = {}
    if g["source"] != "hub":  # the hub's rows come with the download: the stage counts them
        for split in ("test", "train"):
            try:
                rows[split] = gsm8k.load_split(g, split)[0]
            except (gsm8k.DataError, OSError, ValueError) as e:
                return [(f"{key}.{split}", str(e).removeprefix(f"{key}.{split}: "))]
    test, train = rows.get("test"), rows.get("train")
    what = "the embedded" if g["source"] == "embedded" else "the"
    if g["limit"] is None:
        g["limit"] = min(LIMIT, len(test)) if test else LIMIT
    elif test is not None and g["limit"] > len(test):
        return [(f"{key}.limit", f"{g['limit']} rows asked, {what} test data has {len(test)}; leave limit unset "
                                 f"(null) for all its rows, at most {LIMIT}")]
    if train is not None and g["shots"] is not None and g["shots"] > len(train):
        return [(f"{key}.shots", f"{g['shots']} shots asked, {what} train data has {len(train)}")]
    if g["max_tokens"] is None:
        g["max_tokens"] = MAX_TOKENS if context is None else max(1, min(MAX_TOKENS, context // 4))
    elif context is not None and g["max_tokens"] >= context:
        return [(f"{key}.max_tokens", f"{g['max_tokens']} tokens do not fit the model's context of {context} "
                                      "(max_position_embeddings) beside a prompt")]
    if tok is None or context is None or test is None:
        if g["shots"] is None:
            g["shots"] = SHOTS if train is None else min(SHOTS, len(train))
        return []

    def longest(shots: int) -> int:
        return max(len(tok.encode(it["prompt"]).ids) for it in gsm8k.build_prompts(test, train, g["limit"], shots))

    explicit = g["shots"] is not None
    shots = g["shots"] if explicit else min(SHOTS, len(train))
    while not explicit and shots > 0 and longest(shots) + g["max_tokens"] > context:
        shots -= 1
    g["shots"] = shots
    if (n := longest(shots)) + g["max_tokens"] > context:
        return [(f"{key}.shots" if explicit else f"{key}.max_tokens",
                 f"the longest prompt ({n} tokens, {shots} shots) + max_tokens {g['max_tokens']} exceed the model's "
                 f"context of {context} tokens (max_position_embeddings); lower quality.gsm8k.shots or max_tokens")]
    return []
