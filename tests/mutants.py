"""Small known engine bugs, applied to a scratch copy of `engine/` (never to the tree under test).

Each mutant is one textual edit of `engine/model.py`. The logic mutants change the maths a little (on the tiny
model the float32 log-probs move by 0.02-0.5 nats at most, 0.003-0.04 on average); the row mutant breaks only the
rows after the first of a batch; the precision mutant changes only the dtype of a reduction, so in float32 it is
no change at all. `scratch(root, name)` writes the mutated package under root; put root first on PYTHONPATH.
`applied(model, name)` swaps the mutated classes into an engine already loaded (tools/device_parity.py: one
load of a 15.7B-parameter model serves every mutant). `serve(root, name, ...)` runs the mutated engine's
OpenAI-compatible server, an endpoint target for the quality gate (tests/test_quality_mutants.py); `serving` starts
several at once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name: (kind, what it breaks, old text, new text)
MUTANTS = {
    "norm_eps_x100": ("logic", "RMSNorm epsilon x 100",
                      "torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)",
                      "torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps * 100)"),
    "softmax_scale_x1.01": ("logic", "attention softmax scale x 1.01",
                            "scores = torch.einsum(\"bthd,bshd->bhts\", q.float(), k.float()) * self.scale",
                            "scores = torch.einsum(\"bthd,bshd->bhts\", q.float(), k.float()) * (self.scale * 1.01)"),
    "route_drop_smallest": ("logic", "routing: the smallest selected expert's weight zeroed",
                            "weights, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)",
                            "weights, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)\n"
                            "        weights = weights.scatter(-1, weights.argmin(-1, keepdim=True), 0.0)"),
    "shared_experts_x0.98": ("logic", "shared experts' output x 0.98",
                             "out = out + self.shared_experts(x)", "out = out + 0.98 * self.shared_experts(x)"),
    "decode_skips_pos1": ("logic", "decode attention skips cache position 1",
                          "freqs_cis = self.freqs_cis(pos)",
                          "mask = mask.clone()\n        if T == 1 and length > 2:\n            mask[..., 1] = False\n"
                          "        freqs_cis = self.freqs_cis(pos)"),
    "yarn_hard_ramp": ("logic", "rope: yarn's linear ramp replaced by a step",
                       "extrapolation_factor = 1 - ramp", "extrapolation_factor = 1 - (ramp > 0.5).float()"),
    "rows_skip_pos1": ("rows", "batched decode: rows after the first skip cache position 1",
                       "freqs_cis = self.freqs_cis(pos)",
                       "mask = mask.clone()\n        if T == 1 and length > 2 and B > 1:\n            mask[1:, ..., 1] = False\n"
                       "        freqs_cis = self.freqs_cis(pos)"),
    "norm_in_low_dtype": ("precision", "RMSNorm's mean of squares in the model dtype, not float32",
                          "h = x.float()\n", "h = x\n"),
    # one prompt on every row has no padding to count: parity's ragged batch (float32) and the bench's distinct
    # prompts are what can see this one
    "prefill_counts_padding": ("rows", "batched prefill: a ragged row's padding counted in its length",
                               "cache.lengths[rows] += T if lengths is None else lengths.to(dev)",
                               "cache.lengths[rows] += T"),
}
# DeepSeek-V4's: one textual edit of engine/deepseek_v4.py each, (kind, what it breaks, old text, new text)
V4_MUTANTS = {
    "v4_sinks_dropped": ("logic", "attention sinks left out of the softmax",
                         "sink = self.sinks.float()[None, :, None, None].expand(B, H, T, 1)",
                         'sink = torch.full((B, H, T, 1), float("-inf"), device=x.device)'),
    "v4_comb_untransposed": ("logic", "hyper-connections: the comb matrix applied untransposed",
                             "torch.matmul(comb.to(dt).transpose(-1, -2), h)", "torch.matmul(comb.to(dt), h)"),
    "v4_csa_halves_swapped": ("logic", "CSA compressor: the overlapping windows' halves swapped",
                              "wk = torch.cat([wk[:, :, :d, :m], wk[:, :, d:, m:]], dim=-1)",
                              "wk = torch.cat([wk[:, :, d:, :m], wk[:, :, :d, m:]], dim=-1)"),
    "v4_indexer_no_relu": ("logic", "lightning indexer: scores without the relu",
                           "scores = F.relu(torch.matmul(", "scores = (torch.matmul("),
    "v4_window_short_by_one": ("logic", "sliding window one position short",
                               "(pos[..., None] - kpos[:, None, :] < W)", "(pos[..., None] - kpos[:, None, :] < W - 1)"),
    "v4_hash_wrong_token": ("logic", "hash routing by the previous row's token",
                            "idx = self.gate.tid2eid[tokens]", "idx = self.gate.tid2eid[tokens].roll(1, dims=0)"),
    "v4_hc_mix_low_dtype": ("precision", "hyper-connection mixing logits in the model dtype, not float32",
                            "mix = F.linear(unit_rms(h.flatten(2).float(), self.eps), self.fn.float())",
                            "mix = F.linear(unit_rms(h.flatten(2), self.eps), self.fn.to(h.dtype)).float()"),
    "v4_norm_in_low_dtype": ("precision", "RMSNorm's mean of squares in the model dtype, not float32",
                             "        h = x.float()\n        return (self.weight", "        h = x\n        return (self.weight"),
}
LOGIC = [n for n, m in MUTANTS.items() if m[0] == "logic"]
PRECISION = [n for n, m in MUTANTS.items() if m[0] == "precision"]
ROWS = [n for n, m in MUTANTS.items() if m[0] == "rows"]


def module_of(name: str) -> str:
    """The engine module mutant `name` edits."""
    return "evident.engine.deepseek_v4" if name in V4_MUTANTS else "evident.engine.model"


def mutated_source(name: str) -> str:
    """engine/model.py with mutant `name` applied (engine/deepseek_v4.py for a V4_MUTANTS one)."""
    _, _, old, new = MUTANTS[name] if name in MUTANTS else V4_MUTANTS[name]
    file = module_of(name).removeprefix("evident.").replace(".", "/") + ".py"
    text = (REPO / file).read_text()
    if text.count(old) != 1:  # the engine moved on: the mutant must be rewritten, not silently skipped
        raise AssertionError(f"mutant {name}: {old!r} occurs {text.count(old)} times in {file}")
    return text.replace(old, new)


def scratch(root: Path, name: str | None) -> Path:
    """A copy of `engine/` under root, with mutant `name` applied (None: unmutated). Returns root."""
    dst = root / "evident" / "engine"  # `evident` is a namespace: this portion comes first, the tree's the rest
    shutil.copytree(REPO / "engine", dst, ignore=shutil.ignore_patterns("__pycache__"))
    if name is not None:
        (root / (module_of(name).replace(".", "/") + ".py")).write_text(mutated_source(name))
    return root


# the opening of a `python -c` program run on a scratch copy (sys.argv[1]: its root): it must import the copy
GUARD = ("import sys\nimport evident.engine.model as _m\n"
         "assert _m.__file__.startswith(sys.argv[1]), _m.__file__\n")


def env(src: Path) -> dict:
    """The environment of a subprocess that imports `engine` from the scratch copy under src (and the rest from the
    tree). Python puts a `-c` program's or a `-m` module's working directory first on sys.path: run it in src."""
    path = [str(src), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def endpoint_name(name: str) -> str:
    """A mutant's name as a quality target's (lower case, digits and '-')."""
    return name.replace("_", "-").replace(".", "-")


@contextlib.contextmanager
def serve(root: Path, name: str, ckpt: Path, dtype: str, device: str = "cpu"):
    """The engine server (targets.engine_server) of a scratch copy of the engine with mutant
    `name`, an endpoint target for the quality gate: yields its base URL ending in /v1; always stopped. Its log
    is root/logs/serve.log."""
    from evident.workflow.plan import targets

    src = scratch(root, name)
    with targets.engine_server(ckpt, device, dtype, root / "logs/serve.log", code=src, env=env(src)) as (url, _):
        yield url


@contextlib.contextmanager
def serving(servers: dict):
    """Several `serve` endpoints at once: servers is {key: (root, name, ckpt, dtype)}; yields {key: base URL}. The
    servers start together (each start is seconds of imports and loading, on one core) and are all stopped."""
    from concurrent.futures import ThreadPoolExecutor

    with contextlib.ExitStack() as stack:
        cms = {key: serve(*args) for key, args in servers.items()}
        with ThreadPoolExecutor(max(1, len(cms))) as pool:
            started = {key: pool.submit(cm.__enter__) for key, cm in cms.items()}
        urls, error = {}, None
        for key, future in started.items():
            try:
                urls[key] = future.result()
            except BaseException as e:  # the others are stopped by the stack, this one was never started
                error = error or e
            else:
                stack.push(cms[key].__exit__)
        if error is not None:
            raise error
        yield urls


def mutated_module(name: str) -> types.ModuleType:
    """engine/model.py (engine/deepseek_v4.py for a V4 mutant) with mutant `name` applied, as a module."""
    target = module_of(name)
    mod = types.ModuleType(f"{target}_mutant")
    mod.__package__ = "evident.engine"
    exec(compile(mutated_source(name), f"{target} ({name})", "exec"), mod.__dict__)
    return mod


@contextlib.contextmanager
def applied(model, name: str):
    """Within the block, every module of the loaded engine ``model`` runs the mutated engine/model.py's class
    of its name, and the rope tables are the mutated ones (engine/deepseek_v4.py's classes for a V4 mutant)."""
    import evident.engine.deepseek_v4
    import evident.engine.model

    v4 = name in V4_MUTANTS
    target = evident.engine.deepseek_v4 if v4 else evident.engine.model
    mod = mutated_module(name)
    saved = [(m, type(m)) for m in model.modules() if type(m).__module__ == target.__name__]
    rope = None if v4 else (model.inv_freq, model.attention_scaling)
    try:
        for m, cls in saved:
            m.__class__ = getattr(mod, cls.__name__)
        if not v4:
            a = model.args
            model.inv_freq, model.attention_scaling = mod.rope_inv_freq(a.rope_parameters, a.qk_rope_head_dim,
                                                                        a.max_position_embeddings)
        yield
    finally:
        for m, cls in saved:
            m.__class__ = cls
        if rope is not None:
            model.inv_freq, model.attention_scaling = rope
