"""Greedy batched generation over the engine's Transformer.

The prompts are prefilled together (one forward of the batch, ragged prompts padded on the right; each row is a
row of the cache with its own length), then all unfinished rows decode together, one batched forward per step
(``Rows``, the loop, where rows may also join between steps: engine.serve's ``--join step``). Each step is launched
before the last one's tokens reach the host, its input the last one's picks on the device: on the graph path the
device does not wait for the host between steps (docs/decode-log.md measures what that wait cost; the eager forward
synchronises inside each step anyway), and the picks are made and written as the next inputs inside the captured step.
Under expert parallelism every rank calls ``generate`` in lockstep with the same prompts; the combined logits are
identical on every rank, so every rank picks the same tokens. Usage::

    python -m evident.engine.generate --checkpoint DIR --prompt-ids 1,2,3 --max-new-tokens 16
    torchrun --nproc_per_node 2 -m evident.engine.generate --backend host-staged --checkpoint DIR --prompt-ids 1,2,3

``forced`` runs the same prefill and batched decode step teacher-forced: each step is fed a given token instead
of the greedy pick, so the engine's logits can be compared with a reference along one shared token path.
"""
from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .checkpoint import load_model
from .model import LatentCache, Transformer, picks
from .parallel import BACKENDS, init_from_env

MAX_BATCH = 8


@dataclass
class Generation:
    tokens: list[list[int]]  # per row: generated ids only (EOS included when emitted)
    margins: list[list[float]]  # per row, per step: top1 - top2 fp32 logit of the engine


def _check_batch(prompts) -> None:
    if not isinstance(prompts, (list, tuple)) or not 1 <= len(prompts) <= MAX_BATCH:
        n = len(prompts) if isinstance(prompts, (list, tuple)) else type(prompts).__name__
        raise ValueError(f"batch size must be between 1 and {MAX_BATCH} prompts, got {n}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")


def fits(model: Transformer, prompts, new_tokens: int) -> bool:
    """The length rule: every prompt plus new_tokens within the context (the cache is sized to the longest)."""
    return all(len(p) + new_tokens <= model.args.max_position_embeddings for p in prompts)


def _check_length(model: Transformer, prompts, new_tokens: int) -> None:
    limit = model.args.max_position_embeddings
    for i, p in enumerate(prompts):
        if not fits(model, [p], new_tokens):
            raise ValueError(f"prompt {i}: {len(p)} prompt tokens + {new_tokens} new tokens exceed "
                             f"max_position_embeddings={limit}")


def _cache(model: Transformer, rows: int, max_len: int) -> LatentCache:
    graph = model.graph_decode
    return graph.cache(rows, max_len) if graph is not None else model.new_cache(rows, max_len)


def _prefill(model: Transformer, cache: LatentCache, prompts: list[list[int]], slots: list[int]) -> list[torch.Tensor]:
    """Each prompt into its cache row (prompts[i] into row slots[i]) -> each one's logits [len(prompts[i]), vocab].

    The rows go through together: one forward of the batch right-padded to its longest prompt, for a model that takes
    padding; else (DeepSeek-V4, whose window and compressor state a padded token would overwrite) one forward per
    prompt length, each over the rows of that length. On the graph path that forward is its captured prefill
    (``GraphDecode.prefill``).
    """
    device = model.embed_tokens.weight.device
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(0 if model.takes_padding else len(p), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(prompts)
    for group in groups.values():
        lengths = [len(prompts[i]) for i in group]
        width = max(lengths)
        tokens = torch.tensor([prompts[i] + [prompts[i][-1]] * (width - len(prompts[i])) for i in group],
                              dtype=torch.long, device=device)
        rows = torch.tensor([slots[i] for i in group], device=device)
        if getattr(model.graph_decode, "prefill", None) is not None:  # captured, as the step (engine/graph_decode.py)
            logits = model.graph_decode.prefill(cache, tokens, rows, torch.tensor(lengths, device=device))
        else:
            extra = {} if len(set(lengths)) == 1 else {"lengths": torch.tensor(lengths, device=device)}
            logits = model(tokens, cache, rows, **extra)
        for k, i in enumerate(group):
            out[i] = logits[k, :lengths[k]]
    return out


def _decode(model: Transformer, cache: LatentCache, tokens: torch.Tensor, rows: list[int],
            index: torch.Tensor) -> torch.Tensor:
    """One batched decode step -> logits [len(rows), vocab] of ``rows`` (``index``: the same on the device); ``tokens``
    [W] holds the input token of every cache row up to the last of ``rows`` (the graph step advances each of them; the
    eager forward only ``rows``)."""
    if model.graph_decode is not None:
        # the step's logits are its graph's own buffer, rewritten by the next step: the caller gets a copy it may keep
        logits = model.graph_decode.step(cache, tokens)
        return logits.clone() if len(rows) == tokens.shape[0] else logits.index_select(0, index)
    return model(tokens.index_select(0, index)[:, None], cache, index)[:, -1]


@dataclass
class Launched:
    """A decode step on its way: its rows' picks coming back to the host (``Rows.launch``, ``Rows.finish``)."""
    slots: list[int]
    joined: list[int]  # each slot's join count at the launch: the pick of a row that has left since is dropped
    ids: torch.Tensor  # [len(slots)] on the host once ``done`` has passed
    margins: torch.Tensor
    done: torch.cuda.Event | None  # None on the CPU, where the copies are done on return


class Rows:
    """Rows decoding together in one cache of ``slots`` rows: ``generate``'s loop, and a server's.

    Rows ``join`` between steps, prefilled together into free slots (the lowest first, each row at its own length); a
    ``step`` advances the live rows together, one token each (``advance`` picks them); a row leaves when done and its
    slot is free for the next to join. The graph step advances every slot up to the highest ever joined (its width
    only grows, so a batch captures a graph only where a row joins above it): a free slot among them is stepped at
    position 0 and its results never read, so it can never run past the cache. Made and used under
    ``torch.inference_mode`` (a graph path's caches are made in it and reused).

    Each slot's next input token stays on the device (``inputs``), where the step's own picks write it (on the graph
    path the step's own buffer, written inside the captured step: between replays only the picks' copies to the host
    run outside it): ``launch`` starts a step without waiting for the one before it to reach the host, so the host's
    work on step k's tokens overlaps step k + 1 on the device, and the device does not wait on the host between steps
    (``finish`` takes the tokens; a step launched for a row that has left since is dropped)."""

    def __init__(self, model: Transformer, slots: int, max_len: int):
        self.model = model
        self.cache = _cache(model, slots, max_len)
        self.device = model.embed_tokens.weight.device
        graph = model.graph_decode
        # each slot's next input token: on the graph path the buffer the step reads and writes its picks to
        self.inputs = (graph.inputs(self.cache) if graph is not None
                       else torch.zeros(slots, dtype=torch.long, device=self.device))
        self.counter = torch.zeros(1, dtype=torch.int32, device=self.device)  # the pick kernel's
        self.live = [False] * slots
        self.joined = [0] * slots  # rows joined at each slot so far
        self.width = 0  # the slots a step advances: up to the highest ever joined
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}

    def free(self) -> int:
        return self.live.count(False)

    def has_room(self, prompt: list[int], new_tokens: int) -> bool:
        """Whether the cache (its length fixed at the start) has room for a row of this prompt and new_tokens."""
        return len(prompt) + new_tokens <= self.cache.max_len

    def _index(self, slots: list[int]) -> torch.Tensor:
        """These slots as a device index, copied once per set of slots: a copy from pageable host memory would wait for
        the steps in flight."""
        key = tuple(slots)
        if len(self._indices) > 256:  # a server's batch meets a few of its 2**slots sets
            self._indices.clear()
        if key not in self._indices:
            index = torch.tensor(key, dtype=torch.long)
            self._indices[key] = (index.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda"
                                  else index)
        return self._indices[key]

    def join(self, prompts: list[list[int]]) -> tuple[list[int], list[torch.Tensor]]:
        """Prompts prefilled together into free slots -> (their slots, each one's logits [len(prompt), vocab]: the
        last position's picks its first token)."""
        free = [s for s, on in enumerate(self.live) if not on]
        if len(prompts) > len(free) or not all(self.has_room(p, 0) for p in prompts):
            raise ValueError(f"join: {len(prompts)} prompts for {len(free)} free slots of a cache of "
                             f"{self.cache.max_len} positions")
        slots = free[:len(prompts)]
        self.cache.reset_rows(slots)
        logits = _prefill(self.model, self.cache, prompts, slots)
        for s in slots:
            self.live[s] = True
            self.joined[s] += 1
        self.width = max(self.width, slots[-1] + 1)
        return slots, logits

    def advance(self, slots: list[int], logits: torch.Tensor, take: Callable[[int, int, float], bool]) -> None:
        """Greedy picks from these slots' logits [len(slots), vocab], each the input of its slot's next step and
        handed to ``take(slot, token, top1 - top2 margin)``, which says whether its row ends there (it leaves)."""
        ids, margins = self._pick(slots, logits)
        self._hand(slots, [self.joined[s] for s in slots], ids.tolist(), margins.tolist(), take)

    def _pick(self, slots: list[int], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy picks of these slots (ids, margins on the device), written as their next inputs."""
        ids, margins = picks(logits, self.model.pick_kernel, self.counter)
        self.inputs[self._index(slots)] = ids
        return ids, margins

    def _hand(self, slots, joined, ids, margins, take) -> int:
        """Each pick to ``take`` if its slot still holds the row it was picked for (a row that leaves, leaves) -> how
        many were handed."""
        handed = 0
        for s, j, t, m in zip(slots, joined, ids, margins):
            if self.live[s] and self.joined[s] == j:
                handed += 1
                if take(s, t, m):
                    self.leave(s)
        return handed

    def leave(self, slot: int) -> None:
        self.live[slot] = False

    def _live(self) -> list[int]:
        """The live slots below the width; an idle one among them is set back to position 0 (stepped, never read)."""
        if idle := [s for s in range(self.width) if not self.live[s]]:
            self.cache.lengths[self._index(idle)] = 0
        return [s for s in range(self.width) if self.live[s]]

    def step(self) -> tuple[list[int], torch.Tensor]:
        """One batched decode step -> (the live slots, their logits [len, vocab]), for ``advance``."""
        live = self._live()
        return live, _decode(self.model, self.cache, self.inputs[:self.width], live, self._index(live))

    def launch(self) -> Launched:
        """One batched decode step whose picks feed the next step on the device; ``finish`` hands them over."""
        graph = self.model.graph_decode
        # on the graph path picked in the step and written as the next inputs there (its logits are not needed here);
        # an idle slot's pick overwrites its input too, harmless: its results are never read, and a joining row's
        # first token is written by advance
        if graph is not None:
            live = self._live()
            graph.step(self.cache, self.inputs[:self.width], logits=False)
            ids, margins = graph.picks(self.cache, self.width)
            if len(live) < self.width:
                ids, margins = (t.index_select(0, self._index(live)) for t in (ids, margins))
        else:
            live, logits = self.step()
            ids, margins = self._pick(live, logits)
        cuda = self.device.type == "cuda"
        out = Launched(live, [self.joined[s] for s in live], ids.to("cpu", non_blocking=cuda),
                       margins.to("cpu", non_blocking=cuda), torch.cuda.Event() if cuda else None)
        if out.done is not None:
            out.done.record()
        return out

    def finish(self, step: Launched, take: Callable[[int, int, float], bool]) -> int:
        """A launched step's picks, each handed to ``take`` as in ``advance`` if its row is still the one live in its
        slot -> how many were handed."""
        if step.done is not None:
            step.done.synchronize()
        return self._hand(step.slots, step.joined, step.ids.tolist(), step.margins.tolist(), take)

    def ahead(self, pending: Launched | None, take: Callable[[int, int, float], bool], launch: bool = True,
              around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
              ) -> tuple[Launched | None, int]:
        """The loop's turn: step k + 1 launched (if ``launch``, inside ``around()``), then step k's (``pending``'s)
        picks handed to ``take`` while it runs, even if the launch failed (what step k made still reaches its rows) ->
        (the launched step, how many of ``pending``'s picks were handed). A row that ends at step k has had step k + 1
        run for it: its pick is dropped."""
        launched, handed = None, 0
        try:
            if launch:
                with around():
                    launched = self.launch()
        finally:
            if pending is not None:
                handed = self.finish(pending, take)
        return launched, handed


def forced(model: Transformer, prompts: list[list[int]], continuations: list[list[int]],
           observe: Callable[[torch.Tensor], None]) -> None:
    """Teacher-forced pass: prefill the prompts (together, as ``generate``), then feed ``continuations``
    through the batched decode step, every row each step, the given token instead of the greedy pick.

    ``observe(logits)`` gets [B, T, vocab] logits: first of every prompt position (T = prompt length), then of
    each decode step (T = 1). Position p predicts token p + 1 of prompt + continuation, so the last continuation
    token is never fed. Prompts must share one length, and continuations another (rows advance together).
    """
    _check_batch(prompts)
    if len({len(p) for p in prompts}) != 1 or len(continuations) != len(prompts) or \
            len({len(c) for c in continuations}) != 1:
        raise ValueError("forced: every row needs a prompt of the same length and a continuation of the same length")
    steps = len(continuations[0])
    _check_length(model, prompts, steps)
    B = len(prompts)
    with torch.inference_mode():  # the cache too: a graph step's cache is reset in place
        cache = _cache(model, B, len(prompts[0]) + steps)
        observe(model(torch.tensor(prompts, device=model.embed_tokens.weight.device), cache))  # one length
        rows = torch.arange(B, device=cache.lengths.device)
        for i in range(steps - 1):
            tokens = torch.tensor([c[i] for c in continuations], device=rows.device)
            observe(_decode(model, cache, tokens, list(range(B)), rows)[:, None])


def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
             eos_token_id: int | list[int] | None = None,
             progress: Callable[[int, int], None] | None = None,
             stop: Callable[[int, list[int]], bool] | None = None,
             around: Callable[[int, int], contextlib.AbstractContextManager] | None = None,
             observe: Callable[[list[int], torch.Tensor], None] | None = None) -> Generation:
    """Greedy-decode up to ``max_new_tokens`` for each prompt (1..8 prompts, any lengths).

    A row stops after emitting an EOS id (kept in its output) or at max_new_tokens.
    ``progress(step, total)`` is called after the prefill (step 1) and after each batched decode step,
    with step = tokens generated so far by the longest row and total = max_new_tokens.
    ``stop(row, tokens)`` is called after each token a row emits (tokens: its generated ids so far); when it
    returns true the row stops there (a server's stop strings, streaming).
    ``around(step, total)`` returns a context manager entered around the work of each step (step 1: the prefill of
    every row and its pick; then the launch of each batched decode step, ``Rows.launch``), numbered as ``progress``
    numbers them: a profiler range, or a timer that synchronises on exit, wraps exactly one step, and a CUDA event
    recorded on exit marks the step's end on the device (the host is told of its tokens later, while the next step
    runs: ``progress`` is called then).
    ``observe(rows, logits)`` gets the logits [len(rows), vocab] that the next token of each of ``rows`` is picked
    from, before the pick (a server's log-probs); with it the steps run one at a time, each waiting for the host.
    """
    _check_batch(prompts)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    _check_length(model, prompts, max_new_tokens)
    eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
    B = len(prompts)
    out = Generation(tokens=[[] for _ in range(B)], margins=[[] for _ in range(B)])
    if max_new_tokens == 0:
        return out

    around = around or (lambda step, total: contextlib.nullcontext())

    def take(r: int, t: int, m: float) -> bool:
        out.tokens[r].append(t)
        out.margins[r].append(m)
        ended = t in eos or len(out.tokens[r]) >= max_new_tokens
        return (stop is not None and stop(r, out.tokens[r])) or ended  # stop hears of every token

    def emit(slots: list[int], logits: torch.Tensor) -> None:
        if observe is not None:
            observe(slots, logits)
        rows.advance(slots, logits, take)

    with torch.inference_mode():
        rows = Rows(model, B, max(len(p) for p in prompts) + max_new_tokens)
        with around(1, max_new_tokens):
            slots, logits = rows.join(prompts)  # slots 0..B-1, in order
            emit(slots, torch.stack([t[-1] for t in logits]))
        if progress is not None:
            progress(1, max_new_tokens)
        if observe is not None:  # the logits of each step, before its pick: one step at a time
            for step in range(2, max_new_tokens + 1):
                if rows.free() == B:  # every row done
                    break
                with around(step, max_new_tokens):
                    emit(*rows.step())
                if progress is not None:
                    progress(step, max_new_tokens)
            return out
        # step k + 1 is launched before step k's tokens reach the host (never past step max_new_tokens, so a row's
        # step after its last token stays within its cache)
        pending = None
        for step in range(2, max_new_tokens + 2):
            pending, handed = rows.ahead(pending, take, step <= max_new_tokens and rows.free() < B,
                                         lambda: around(step, max_new_tokens))
            if handed and progress is not None:
                progress(step - 1, max_new_tokens)
            if pending is None:
                break
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m evident.engine.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--prompt-ids", required=True, action="append",
                    help="comma-separated token ids; repeat for a batch")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--eos-token-id", type=int, action="append", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--backend", default="single", choices=("single", *BACKENDS),
                    help="single device, or expert parallel (launch with torchrun --nproc_per_node N; rank 0 prints)")
    a = ap.parse_args(argv)
    prompts = [[int(x) for x in p.split(",") if x.strip()] for p in a.prompt_ids]
    ep = None
    if a.backend != "single":
        try:
            ep = init_from_env(a.backend, a.device)
        except RuntimeError as e:
            ap.error(str(e))
    try:
        model = load_model(a.checkpoint, device=a.device if ep is None else ep.device, dtype=getattr(torch, a.dtype),
                           ep=ep)
        gen = generate(model, prompts, a.max_new_tokens, a.eos_token_id)
    finally:
        if ep is not None:
            ep.close()
    if ep is None or ep.rank == 0:
        for row in gen.tokens:
            print(",".join(map(str, row)))


if __name__ == "__main__":
    main()
