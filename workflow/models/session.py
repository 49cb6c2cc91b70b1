"""An engine session for a stage: config, device, expert-parallel ranks, model, tokenizer.

Stages that run the engine (parity, bench) run once per backend; EP backends are launched with
torchrun, every rank runs the same stage code in lockstep and only rank 0 writes evidence.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from evident.engine.checkpoint import enable_decode_path, eos_ids, load_model
from evident.engine.parallel import init_from_env
from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, read_config, read_json, stage_args
from evident.workflow.models import checkpoints, hf
from evident.workflow.plan import environment
from evident.workflow.plan.runs import BACKENDS, HF_PATHS, KERNELS, run_name


def is_primary() -> bool:
    """Rank 0 under torchrun, or the only process: the one that writes evidence and prints."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass
class Session:
    config: dict
    backend: str
    device: str
    model: object
    tokenizer: Tokenizer
    eos: list[int]
    ep: object | None
    kernels: str
    checkpoint: Path | None = None

    def reload(self, dtype: str) -> None:
        """Swap the model for the same checkpoint and decode path in another dtype (the old one is freed first)."""
        graph = self.model.graph_decode
        if graph is not None:  # its captured graphs (and V2/V3's stacks) hold device memory of their own
            graph.release()
        self.model.to("meta")
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.model = load_engine(self.checkpoint, self.device, dtype, self.ep, self.kernels)

    @property
    def primary(self) -> bool:
        return is_primary()

    @property
    def params(self) -> dict:
        p = {"backend": self.backend, "kernels": self.kernels, "dtype": self.config["dtype"], "device": self.device}
        if self.ep is not None:
            p.update(ep_size=self.ep.world_size, collective=self.ep.collective_backend)
        return p


def engine_args(doc: str, backends: tuple[str, ...] = BACKENDS) -> argparse.ArgumentParser:
    """The command line every engine stage takes."""
    ap = stage_args(doc, checkpoint=True)
    ap.add_argument("--backend", required=True, choices=backends)
    ap.add_argument("--batch-sizes", required=True, type=lambda text: [int(b) for b in text.split(",")])
    ap.add_argument("--kernels", default="torch", choices=KERNELS)
    return ap


@contextlib.contextmanager
def engine_stage(kind: str, args: argparse.Namespace):
    """The stage record `<kind>-<run name>` around an engine session (one process group per run:
    the model is loaded once for every batch size)."""
    with Stage(args.evidence, f"{kind}-{run_name(args.backend, args.kernels)}", primary=is_primary()) as st, \
            open_session(args.checkpoint, args.evidence, args.backend, args.kernels) as s:
        st.params.update(s.params, batch_sizes=args.batch_sizes)
        yield st, s


def load_engine(ckpt_dir: Path, device: str, dtype: str, ep, kernels: str):
    """The engine in ``dtype`` with its decode path: the Triton kernels when kernels is `triton`, the CUDA-graph
    step when `graph`."""
    model = load_model(ckpt_dir, device=device, dtype=checkpoints.DTYPES[dtype], ep=ep)
    if kernels != "torch" and device == "cpu":  # no GPU: Triton's interpreter runs the kernels (slowly)
        environment.require_interpreter(f"the engine's {kernels} decode path")
    return enable_decode_path(model, kernels)


@contextlib.contextmanager
def open_session(ckpt_dir: Path, evidence: Path, backend: str, kernels: str = "torch"):
    """Verify the checkpoint against checkpoint.json, join the EP group, load the engine (with the
    Triton decode path when kernels is `triton`, the CUDA-graph step when `graph`); a backend of HF_PATHS loads
    transformers' model instead, as the oracle does but with that path's experts (the benchmark's reference in the
    same run)."""
    if backend not in (*BACKENDS, *HF_PATHS) or kernels not in KERNELS:
        raise ValueError(f"unknown backend {backend!r} or kernels {kernels!r}; expected one of "
                         f"{(*BACKENDS, *HF_PATHS)} and {KERNELS}")
    config = read_config(evidence / layout.CONFIG)
    device = environment.resolve_device(config["device"])
    checkpoints.verify(ckpt_dir, read_json(evidence / layout.CHECKPOINT))
    if device.startswith("cuda"):
        torch.set_num_threads(1)  # the host only launches kernels: idle OpenMP workers add jitter
    # The tokenizer library itself (not transformers): the engine path imports no transformers code, and the
    # hf backend gets the engine's prompt ids exactly.
    tok = Tokenizer.from_file(str(ckpt_dir / "tokenizer.json"))
    if backend in HF_PATHS:
        _, model = hf.load(ckpt_dir, config["dtype"], device, **HF_PATHS[backend][0])
        yield Session(config, backend, device, model, tok, eos_ids(ckpt_dir), None, "torch")
        return
    ep = None
    if backend != "single":
        ep = init_from_env(backend, device)
        device = str(ep.device)
    try:
        model = load_engine(ckpt_dir, device, config["dtype"], ep, kernels)
        yield Session(config, backend, device, model, tok, eos_ids(ckpt_dir), ep, kernels, ckpt_dir)
        if ep is not None:  # ranks leave together: one tore its gloo group down while rank 0 still wrote, and aborted
            ep.barrier()
    finally:
        if ep is not None:
            ep.close()

