"""Expert parallelism over torch.distributed ranks (launched with ``torchrun``).

Every rank holds the replicated weights (attention, dense MLPs, shared experts, router, embeddings, norms,
lm_head) and a contiguous shard of each MoE layer's routed experts. Every rank runs the same tokens; the
router is computed identically everywhere, each rank accumulates its local experts' contributions into an
fp32 partial, and ``ExpertParallel.combine`` sums the partials over ranks. Two combines:

``host-staged``  copy the partial to host memory (pinned on CUDA), all_gather the host copies over a gloo
                 group, sum them on the host in rank order 0..N-1 (deterministic, identical on every rank),
                 copy the sum back to the device.
``collective``   ``dist.all_reduce`` on the device tensor (NCCL on GPUs, gloo on CPU).

Usage (every rank, in lockstep)::

    ep = init_from_env("host-staged", "cuda")   # under: torchrun --nproc_per_node N ...
    model = load_model(ckpt, device=ep.device, ep=ep)
    gen = generate(model, prompts, 16)          # same prompts on every rank -> same tokens on every rank
    ep.close()
"""
from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist

BACKENDS = ("host-staged", "collective")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"expert-parallel backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


class ExpertParallel:
    """One rank's view of an expert-parallel group. ``world_size == 1`` needs no process group."""

    def __init__(self, rank: int, world_size: int, backend: str, device: torch.device | str = "cpu",
                 collective_backend: str | None = None, host_group=None, owns_default_group: bool = False):
        _check_backend(backend)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        self.collective_backend = collective_backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self._host_group = host_group  # gloo group for host staging (None: the default group)
        self._owns_default_group = owns_default_group
        self._pinned: torch.Tensor | None = None  # reusable host staging buffer (CUDA only)
        self._before_close: list = []  # callables run first by close()

    def __repr__(self) -> str:
        return (f"ExpertParallel(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"device={str(self.device)!r}, collective_backend={self.collective_backend!r})")

    def describe(self) -> dict:
        """JSON-able facts for evidence files."""
        return {"rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                "device": str(self.device), "collective_backend": self.collective_backend}

    def experts(self, n_experts: int) -> range:
        """This rank's contiguous shard of ``n_experts`` routed experts."""
        if n_experts % self.world_size:
            raise ValueError(f"expert parallel: world_size={self.world_size} does not divide "
                             f"n_routed_experts={n_experts}; launch with a number of ranks that divides {n_experts}")
        per = n_experts // self.world_size
        return range(self.rank * per, (self.rank + 1) * per)

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of each rank's partial (same shape, dtype and device on every rank)."""
        if self.world_size == 1:
            return partial
        if self.backend == "collective":
            dist.all_reduce(partial, op=dist.ReduceOp.SUM)
            return partial
        host = self._to_host(partial)
        gathered = [torch.empty_like(host, device="cpu") for _ in range(self.world_size)]
        dist.all_gather(gathered, host, group=self._host_group)
        total = gathered[0]
        for t in gathered[1:]:  # fixed rank order: the same bits on every rank
            total += t
        return total.to(partial.device)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.detach().cpu().contiguous()
        n = t.numel()
        if self._pinned is None or self._pinned.numel() < n or self._pinned.dtype != t.dtype:
            self._pinned = torch.empty(max(n, 1 << 16), dtype=t.dtype, pin_memory=True)
        host = self._pinned[:n].view(t.shape)
        host.copy_(t)  # blocking: the buffer is reused on the next call
        return host

    def barrier(self) -> None:
        """Wait until every rank gets here (on success only: a barrier after a rank failed would hang)."""
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()

    def before_close(self, fn) -> None:
        """Run ``fn()`` at the start of close(). CUDA graphs that captured NCCL collectives must be freed before the
        communicator is destroyed, or destroy_process_group hangs (pytorch/pytorch#115388)."""
        self._before_close.append(fn)

    def close(self) -> None:
        """Destroy the host-staging group and, if init_from_env created it, the default group."""
        while self._before_close:
            self._before_close.pop()()
        if not dist.is_initialized():
            return
        if self._host_group is not None:
            dist.destroy_process_group(self._host_group)
            self._host_group = None
        if self._owns_default_group:
            dist.destroy_process_group()
            self._owns_default_group = False


# One rendezvous store per process, and a fresh key prefix for every default group built on it: after close(),
# a new group must not read the previous group's keys (its ranks' old addresses) from the torchrun store.
_STORE: dist.Store | None = None
_GENERATION = itertools.count()


def _rendezvous_store() -> dist.Store:
    global _STORE
    if _STORE is None:
        _STORE, _, _ = next(dist.rendezvous("env://"))
    return _STORE


def init_from_env(backend: str, device: str = "cpu") -> ExpertParallel:
    """Join the torchrun job described by RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

    ``device``: ``cpu`` (gloo only), ``cuda`` (cuda:LOCAL_RANK, NCCL default group plus a gloo group for
    host staging) or ``auto``. Reuses an already initialised default group (and then leaves it to its owner).
    """
    _check_backend(backend)
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"expert-parallel backend {backend!r} needs torch.distributed env ({', '.join(missing)} "
                           "not set): launch with `torchrun --nproc_per_node N ...`")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    kind = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                        "cpu" if device == "auto" else device).type
    if kind == "cuda":
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local} needs cuda:{local}, but {torch.cuda.device_count()} CUDA "
                               "device(s) are visible")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    elif kind == "cpu":
        dev = torch.device("cpu")
    else:
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")
    owns = not dist.is_initialized()
    if owns:
        store = dist.PrefixStore(f"engine.parallel/{next(_GENERATION)}", _rendezvous_store())
        if kind == "cuda":
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=dev)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    elif dist.get_world_size() != world or dist.get_rank() != rank:
        raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}, env says rank {rank} of {world}")
    collective = dist.get_backend()
    if kind == "cuda" and collective != "nccl":
        raise RuntimeError(f"CUDA expert parallel needs an NCCL default group, the initialised one is {collective!r}")
    host_group = dist.new_group(backend="gloo") if collective != "gloo" else None  # collective: all ranks call it
    return ExpertParallel(rank, world, backend, dev, collective, host_group, owns_default_group=owns)
