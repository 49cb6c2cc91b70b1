"""SUMMARY.md, the pull-request evidence section, and DETAILS.md beside it, built only from the directory's files.

SUMMARY.md pastes into a GitHub comment: every gate's verdict first, short tables, the claim boundary, no image and
no link (a relative one breaks there). The full tables and the plots are DETAILS.md's, which the archive page
(workflow/archive/pages.py) and MLflow show with its images."""

from __future__ import annotations

from pathlib import Path

from evident.workflow.archive.markup import PAGES
from evident.workflow.bench import floor
from evident.workflow.core import gates, layout
from evident.workflow.core.evidence import list_files, read_config, read_json
from evident.workflow.core.layout import DETAILS, SUMMARY
from evident.workflow.core.verdicts import worst
from evident.workflow.models import checkpoints
from evident.workflow.parity.traces import markdown
from evident.workflow.plan import screens
from evident.workflow.plan.runs import DISTINCT, SAME, SHORT, STAGES, cell_label, cell_prompts, is_rate, label_key


def _at(d: dict) -> str:
    """Where a divergence is: a decode step, or a position inside the prompt (a teacher-forced position before the
    first generated token: compare's step is negative there, its `position` the place in the path)."""
    step = d["step"]
    if step is not None and step < 0:
        return f"prompt position {d['position']}" if d.get("position") is not None else f"inside the prompt (step {step})"
    return f"step {step}"


def divergence(d: dict) -> str:
    """A first divergence (parity/comparison.json), in words."""
    if d.get("kv_cache_dtype"):  # a target's logic check failed where it declares a lower-precision KV cache
        return (f"KV cache in {d['kv_cache_dtype']}: log-prob error {d['abs_delta']:.3g} > tolerance {d['tolerance']:g} "
                f"(row {d['row']} {_at(d)}, token {d['token']}), its cache's rounding, not wrong maths")
    if "char" in d and "oracle_text" in d:  # a text-level target's text against the oracle's
        margin = "n/a" if d["oracle_margin"] is None else f"{d['oracle_margin']:.3g}"
        return (f"text, character {d['char']} (oracle {_at(d)}, margin {margin}): oracle {d['oracle_text']!r} "
                f"vs target {d['target_text']!r}" + (f"; {d['hint']}" if d.get("hint") else ""))
    if "char" in d:
        return f"text, row {d['row']} character {d['char']}: {d['row_text']!r} vs row 0 {d['row0_text']!r}"
    if "alone_token" in d:  # parity's ragged batch, a row against its prompt alone
        return (f"ragged float32, row {d['row']} ({d['case']}) {_at(d)}: {d['token']} vs {d['alone_token']} "
                f"alone (margins: batch {d['batch_margin']:.3g}, alone {d['alone_margin']:.3g})")
    if "collective_token" in d:
        return f"{_at(d)}: host-staged {d['host_staged_token']} vs collective {d['collective_token']}"
    if "oracle_token" in d:
        margin = "n/a" if d["oracle_margin"] is None else f"{d['oracle_margin']:.3g}"
        return f"{_at(d)}: oracle {d['oracle_token']} vs engine {d['engine_token']} (margin {margin})"
    if "abs_delta" in d:
        return (f"forced float32, row {d['row']} {_at(d)}: token {d['token']} log-prob {d['engine_logprob']:.4f} "
                f"vs oracle {d['oracle_logprob']:.4f} (|Δ| {d['abs_delta']:.3g} > {d['tolerance']:g})")
    if "ratio" in d:
        return (f"{d['dtype']} mean |Δ| {d['engine_mean']:.4f} vs transformers' {d['transformers_mean']:.4f}: "
                f"{d['ratio']:.3f}x > {d['bound']:g}x" if d["ratio"] is not None else "transformers made no error")
    if "pair" in d:  # a variant pair's
        return pair_divergence(*d["pair"], d)
    where = f"forced {d['dtype']} " if d.get("forced") else ""
    return f"{where}row {d['row']} {_at(d)}: {d['row_token']} vs row 0 {d['row0_token']}"


def pair_divergence(a: str, b: str, d: dict) -> str:
    """A variant pair's first divergence (compare's pair_cells: row 0 of each, tokens or served text)."""
    if "char" in d:
        return f"text, character {d['char']}: `{a}` {d[a]!r} vs `{b}` {d[b]!r}"
    return f"{_at(d)}: `{a}` {d[a]} vs `{b}` {d[b]}"


def free_running(cases: list[dict], level: str) -> str:
    """The free-running comparison alone (a cell's `free_running`, before the forced checks; a file written before it
    was recorded: the cell's verdict): exact ids and text, or at text level equal text (`text_only`)."""
    got = [c.get("free_running") or c["verdict"] for c in cases]
    if level == "text":
        return f"text: {sum(v in ('text_only', 'all_token_text_exact') for v in got)}/{len(got)} equal"
    return f"{got.count('all_token_text_exact')}/{len(got)} exact"


def parity_section(comparison: dict, dtype: str, top_k: int) -> list[str]:
    """One row per backend x decode path x batch: the free-running cases, then the two teacher-forced checks;
    below, each distinct first divergence with the cells it occurs in."""
    cells, rows = comparison["cells"], []
    for f in comparison["forced"]:
        mine = [c for c in cells if (c["backend"], c["kernels"], c["batch"]) == (f["backend"], f["kernels"], f["batch"])]
        cases = [c for c in mine if c["case"] not in ("all", "ragged")]
        lg, pr = f["logic"], f["precision"]
        prec = (("n/a (float32)" if "target" not in f else f"n/a ({pr['reason']})") if not pr["applies"] else
                f"{pr['engine']['mean']:.4f} / {pr['transformers']['mean']:.4f} = "
                + ("—" if pr["ratio"] is None else f"**{pr['ratio']:.3f}**")
                + f" (cases {', '.join(f'{v:.2f}' for v in pr['case_ratios'].values() if v is not None)})")
        top1 = (f"{lg['top1_agreement']:.2f}" if lg else "—") + (
            f" / {pr['engine']['top1_agreement']:.2f} vs {pr['transformers']['top1_agreement']:.2f}" if pr["applies"] else "")
        logic = "—" if lg is None else f"{lg['max']:.2g}"
        if lg is None and "logic" in f.get("not_checked", {}):
            logic = f"— ({f['not_checked']['logic']})"
        rows.append([f["backend"], f["kernels"] + (f", {f['level']} level" if "target" in f else ""), f["batch"],
                     free_running(cases, f.get("level", "token")),
                     logic, prec, top1, f"`{worst(c['verdict'] for c in mine)}`"])
    transport: dict[tuple, list[str]] = {}
    for c in cells:
        if c["backend"] == "host-staged vs collective":
            transport.setdefault((c["kernels"], c["batch"]), []).append(c["verdict"])
    for (kernels, batch), verdicts in transport.items():
        rows.append(["host-staged vs collective", kernels, batch,
                     f"{verdicts.count('all_token_text_exact')}/{len(verdicts)} equal", "—", "—", "—", f"`{worst(verdicts)}`"])
    seen: dict[str, list[str]] = {}
    for c in cells:
        if c["first_divergence"] and "pair" not in c:  # a variant pair's: its own table (pairs_lines)
            where = f"{c['backend']} {c['kernels']} b{c['batch']}"
            seen.setdefault(f"{c['case']}: {divergence(c['first_divergence'])}", []).append(where)
    near, noise = f"near-tie margin {comparison['near_tie_margin']:.3g}", comparison["near_tie_noise"]
    if noise:
        near += (f": the {noise['quantile']:.0%} quantile of transformers' own {dtype} error on a top-1/top-2 margin "
                 f"over {noise['positions']} positions, floor {noise['floor']:g}")
    out = [
        f"### Parity ({near}; logic tolerance "
        f"{comparison['logic_tolerance']:g} nats; precision bound {comparison['precision_bound']:g}x)",
        "",
        markdown(["backend", "path", "batch", "free-running", "logic: max \\|Δ\\| float32",
                  f"precision: mean \\|Δ\\| {dtype}, engine / transformers", "top-1 agreement", "verdict"], rows),
        "",
        f"\\|Δ\\|: the log-prob difference in nats over the float32 oracle's top-{top_k} ids at every position of "
        "its greedy trace (prompt included), the engine teacher-forced along that trace. Logic: the engine in float32; "
        "precision: the engine in the campaign's dtype against transformers' own error in it, as a ratio. Top-1 "
        "agreement with the float32 oracle: the logic run, then the precision run against transformers'.",
        "",
    ]
    ragged = [c for c in cells if c["case"] == "ragged"]
    if ragged:
        out += ["Ragged batches (float32; row r the prompt of case r mod n, prompts of different lengths prefilled "
                "together; each row against its prompt alone through the same path, a first difference decisive where "
                "both are sure beyond the logic tolerance): "
                + "; ".join(f"{c['backend']} {c['kernels']} b{c['batch']} `{c['ragged']['verdict']}` "
                            f"({len(c['ragged']['differences'])} of {len(c['ragged']['cases'])} rows differ)"
                            for c in ragged), ""]
    if seen:
        out += ["First divergences:", "", *[f"- {d} ({', '.join(w)})" for d, w in seen.items()], ""]
    return (out + targets_lines(comparison.get("targets") or {}, cells, comparison.get("forced", []))
            + pairs_lines(comparison.get("pairs") or []))


FLAGS_WIDTH = 60  # a target's launch arguments, shortened to fit the table


def _engine(t: dict) -> str:
    name, version = t.get("engine"), t.get("version")
    if not name:
        return "—"
    return name + (f" {version}" if version and str(version) not in name else "")


def _weights(t: dict) -> str:
    conv = t.get("converted")
    dtype = t.get("weights_dtype") or "—"
    return dtype + (f"; GGUF `{(conv.get('sha256') or '?')[:12]}`" + (f" ({conv['outtype']})" if conv.get("outtype") else "")
                    if conv else "")


def _flags(args: list[str] | None) -> str:
    if not args:
        return "—"
    text = " ".join(args).replace("|", "\\|")
    return f"`{text if len(text) <= FLAGS_WIDTH else text[:FLAGS_WIDTH - 1] + '…'}`"


def _target_verdict(name: str, t: dict, cells: list[dict], forced: list[dict]) -> str:
    """The verdict; a KV-cache precision gap named in words, with the log-prob error that made it."""
    if t["verdict"] != "kv_cache_precision_gap":
        return f"`{t['verdict']}`"
    d = next((c["first_divergence"] for c in cells if c.get("target") == name
              and c["verdict"] == "kv_cache_precision_gap" and c.get("first_divergence")), None) or {}
    logic = next((f["logic"] for f in forced if f.get("target") == name and f.get("logic")), None) or {}
    error, tol = d.get("abs_delta", logic.get("max")), d.get("tolerance", logic.get("tolerance"))
    figures = f": log-prob error {error:.3g} > tolerance {tol:g}" if error is not None and tol is not None else ""
    return f"`kv_cache_precision_gap` (KV cache in {t.get('kv_cache_dtype') or d.get('kv_cache_dtype')}{figures})"


def targets_lines(engines: dict, cells: list[dict] = (), forced: list[dict] = ()) -> list[str]:
    """The engine targets of `engines:`: each one's verdict, the level it was compared at, what ran (engine, recipe,
    weights, KV cache, launch flags: absent from files written before they were recorded), what was not checked."""
    if not engines:
        return []
    return ["Engine targets (`engines:`; a `text` level compares completions as text only: `text_only` is never "
            "exact):", "",
            markdown(["target", "kind", "level", "forced dtype", "verdict", "not checked", "engine", "recipe",
                      "weights", "kv cache", "flags"],
                     [[f"`{n}`", t["kind"], t["level"], t["dtype"], _target_verdict(n, t, cells, forced),
                       "; ".join(f"{k}: {v}" for k, v in t["not_checked"].items()) or "—", _engine(t),
                       t.get("recipe") or "—", _weights(t), t.get("kv_cache_dtype") or "—", _flags(t.get("args"))]
                      for n, t in engines.items()]),
            ""]


def pairs_lines(pairs: list[dict]) -> list[str]:
    """The variant pairs (`agrees_with`): two entries that must agree token for token (text where either is text)."""
    if not pairs:
        return []
    return ["Variant pairs (row 0 of every case and batch size, one against the other):", "",
            markdown(["pair", "verdict", "first divergence"],
                     [[f"`{p['a']}` vs `{p['b']}`", f"`{p['verdict']}`",
                       f"{d['case']}: {pair_divergence(p['a'], p['b'], d)}" if (d := p.get("first_divergence")) else "—"]
                      for p in pairs]), ""]




def _table(header: list[str], rows: list[list]) -> str:
    """A GitHub table without padding (SUMMARY.md's: a comment pays for every byte)."""
    return "\n".join("| " + " | ".join(map(str, r)) + " |" for r in [header, ["---"] * len(header), *rows])


def _facts(root: Path, config: dict, env: dict, ckpt: dict, git: dict) -> list[str]:
    """What ran: commit, device, versions, checkpoint."""
    pk = env["packages"]
    commit = (git.get("commit") or "unknown")[:12] + (f" + uncommitted source diff {git['dirty'][:8]}" if git.get("dirty") else "")
    t = ckpt.get("trained")
    return [_table(["what", "value"], [
        ["commit", f"`{commit}`"],
        ["device / dtype", f"{_device(env)} / {config['dtype']}"],
        ["torch / transformers", f"{pk.get('torch')} / {pk.get('transformers')}"],
        ["checkpoint", f"{ckpt['source']}" + (f" {ckpt['repo_id']}@{ckpt['revision'][:12]}" if ckpt.get("repo_id") else "")
         + (f" (seed {ckpt['seed']})" if ckpt.get("seed") is not None else "")
         + (f": {t['train']['steps']} steps of {t['train']['batch_size']} x {t['train']['seq_len']} tokens on "
            f"{t['device']}, loss {t['loss']['first']:.3f} → {t['loss']['last']:.3f}" if t else "")],
    ] + [[f"`{name}`", f"sha256 `{f['sha256'][:16]}…`, {f['size']:,} B"]
         for name, f in ckpt["files"].items() if name.endswith(".safetensors")]), ""]


def _device(env: dict) -> str:
    return env["device"] + (f" ({', '.join(env['gpus'])})" if env.get("gpus") else "")


def _documents(root: Path) -> tuple:
    """The config, the oracle's and the comparison's documents and summary.csv, each read once (None when the
    campaign runs neither)."""
    oracle, comparison = (_read(root / rel) for rel in (layout.ORACLE, layout.COMPARISON))
    return read_config(root / layout.CONFIG), oracle, comparison, bench_frames(root)


def render(evidence_dir: str | Path, git: dict) -> str:
    """SUMMARY.md: each gate's verdict with its headline figure, the figures in short, what ran, the claim boundary,
    and where the rest is (DETAILS.md, the archive page, MLflow)."""
    root = Path(evidence_dir)
    config, oracle, comparison, frames = _documents(root)
    env = read_json(root / layout.ENV)
    ckpt = read_json(root / layout.CHECKPOINT)
    skipped = [s for s in STAGES if s not in config["stages"]]
    out = [
        f"## Evidence: `{config['campaign']}` / `{root.name}`",
        "",
        gates_table(root, config, comparison),
        "",
        *parity_headline(oracle, comparison, config),
        *([f"Stages not run (the campaign's `stages:`): {', '.join(skipped)}.", ""] if skipped else []),
        *parity_brief(comparison),
        *bench_brief(root, frames),
        *http_brief(frames),
        *rate_brief(rates := rate_cells(root)),
        *soak_brief(root),
        *profile_brief(root),
        "### What ran",
        "",
        *_facts(root, config, env, ckpt, git),
        "### Claim boundary",
        "",
        *claim_boundary(root, oracle, comparison, config, env, ckpt, frames),
        *rate_soak_boundary(rates, root),
        "",
        f"Plots, full tables and each first divergence: `{DETAILS}` beside this file, the archive page "
        f"`{PAGES}/{config['campaign']}/{root.name}.html` (`evident html`) and the MLflow parent run tagged "
        f"`evident.id={root.name}` in experiment `{config['campaign']}` (`evident ui`).",
        "",
    ]
    return "\n".join(out)


def render_details(evidence_dir: str | Path) -> str:
    """DETAILS.md: every section in full, with its plots (relative images, beside the files they show)."""
    root = Path(evidence_dir)
    config, oracle, comparison, frames = _documents(root)
    return "\n".join([
        f"## Details: `{config['campaign']}` / `{root.name}`",
        "",
        f"The full tables behind `{SUMMARY}`, whose gates, figures and claim boundary hold for them too.",
        "",
        *oracle_section(oracle, comparison, config),
        *bench_section(root, frames, config),
        *http_section(root, frames, config),
        *rate_section(root, rate_cells(root)),
        *soak_section(root),
        *overlap_section(root),
        *audit_section(root),
        *quality_section(root),
        *profile_section(root),
    ])


def claim_boundary(root: Path, oracle, comparison, config: dict, env: dict, ckpt: dict, frames) -> list[str]:
    """What the evidence shows and does not: the parity claims, then quality's and speed's limits."""
    device = _device(env)
    return [
        *parity_claims(oracle, comparison, config, env, ckpt),
        ("- Does not show: quality on trained weights (the checkpoint is random: synthetic weights)"
         if ckpt["source"] == checkpoints.RANDOM else
         "- Does not show: quality beyond the generated arithmetic problems the model was trained for"
         if ckpt["source"] == "trained" else "- Does not show: quality beyond the GSM8K rows evaluated")
        + ", behaviour on other prompts, lengths, dtypes or devices.",
        *([f"- Speed figures hold for this device ({device}) and these benchmark contracts only: `same`, one fixed "
           "prompt copied to every row (so rows route to the same experts)"
           + (", and `distinct`, the campaign's prompts one a row" if config["bench"].get("prompts") else "")
           + "; EOS ignored; noisy cells make no claim. The floor is a model of the bytes a step must read, over a "
             "measured read bandwidth, not a measurement of the step."]
          if frames is not None else []),
        *(["- HTTP figures are the client's, on loopback (127.0.0.1) on this machine: they include the server's "
           "HTTP, JSON and event-stream work and its batching, not a network; a URL target's server ran wherever it "
           "ran. A figure holds for its concurrency, with every request of a round sent at once."]
          if frames and frames[1] is not None else []),
        *([f"- The kernel audit does not cover (why: `{DETAILS}`): {'; '.join(audit['not_covered'])}."]
          if (audit := _read(root / layout.AUDIT)) and audit.get("not_covered") else []),
    ]


# --- SUMMARY.md's short forms: one line or one narrow table a section ------------------------------------------

def gate_outcome(gate: gates.Gate, doc: dict | None, config: dict) -> str:
    """What a gate's verdict means for the run, as the gate stage decides it: a gate not run says so, never a pass."""
    if gate.stage not in config["stages"]:
        return "not run (not in the campaign's `stages:`)"
    if doc is None:
        return "not run (no verdict written)"
    verdict = doc["verdict"]
    if gate.state(verdict) == gates.NOT_RUN:
        return "measured nothing: not a pass"
    if gate.fails(verdict, config):
        return "**fails** (advisory: the run does not fail on it)" if doc.get("advisory") else "**fails the run**"
    return "passes"


def gate_figure(gate: gates.Gate, doc: dict | None, root: Path) -> str:
    """The gate's headline figure: parity's exact cells, the screens' B/A, the audit's spills, quality's accuracy."""
    if doc is None:
        return "—"
    if gate is gates.PARITY:
        cells = doc["cells"]
        return (f"{sum(c['verdict'] == 'all_token_text_exact' for c in cells)}/{len(cells)} cells exact"
                + (f"; {len(doc['targets'])} engine target(s)" if doc.get("targets") else ""))
    if gate.name == "quality":
        return ", ".join(f"`{t}` {r['correct']}/{r['n']}" + (" (reference)" if t == doc["reference"] else "")
                         for t in sorted({doc["reference"], *(x["candidate"] for x in doc["gates"])})
                         if (r := _read(root / layout.quality_result(t))))
    if gate.name == "audit":
        if not doc["kernels"]:
            return doc.get("reason") or "—"
        return f"{len(doc['kernels'])} specialisations, {sum(k['spills'] for k in doc['kernels'])} spills"
    if gate.name == "soak" and doc.get("reason"):  # a failing soak: why, each target's reasons
        return _cell(doc["reason"])
    if "screens" in doc:  # the campaign's screens (overlap/screens.json): each one's verdict
        return ", ".join(f"`{e['name']}` `{e['verdict']}`" for e in doc["screens"])
    envelopes = (doc.get("timing") or {}).get("envelopes") or {}  # the built-in screen's document
    if envelopes:
        return "B/A " + ", ".join(f"{env} {e['ratio_b_over_a']:.3f}" for env, e in envelopes.items())
    return _cell(doc.get("verdict_reason") or doc.get("reason") or "—")


def _oneline(text) -> str:
    """Free text (a server's error, a reason, a log line) on one line."""
    return " ".join(str(text).split())


def _cell(text) -> str:
    """Free text fit for a table cell: one line, no bare `|`."""
    return _oneline(text).replace("|", "\\|")


def _read(path: Path) -> dict | None:
    return read_json(path) if path.is_file() else None


def gates_table(root: Path, config: dict, comparison: dict | None = None) -> str:
    """Every gate of gates.GATES: its verdict, what it means for the run, its headline figure."""
    files = list_files(root)
    rows = []
    for g in gates.GATES:
        rel = gates.document(g, files)
        doc = comparison if g is gates.PARITY and comparison is not None else _read(root / rel) if rel else None
        rows.append([g.name, f"`{doc['verdict']}`" if doc else "—", gate_outcome(g, doc, config),
                     gate_figure(g, doc, root)])
    return _table(["gate", "verdict", "outcome", "headline"], rows)


def parity_brief(comparison: dict | None) -> list[str]:
    """The parity table folded over batch sizes (one row a backend and path), the engine targets trimmed to what a
    reviewer needs; the per-batch rows, the first divergences and what ran for each target are DETAILS.md's."""
    if comparison is None:
        return []
    groups: dict[tuple, dict] = {}
    for f in comparison["forced"]:
        g = groups.setdefault((f["backend"], f["kernels"] + (f", {f['level']} level" if "target" in f else "")),
                              {"batches": [], "cases": [], "verdicts": [], "logic": [], "ratio": [],
                               "level": f.get("level", "token")})
        mine = [c for c in comparison["cells"]
                if (c["backend"], c["kernels"], c["batch"]) == (f["backend"], f["kernels"], f["batch"])]
        g["batches"].append(f["batch"])
        g["cases"] += [c for c in mine if c["case"] not in ("all", "ragged")]
        g["verdicts"] += [c["verdict"] for c in mine]
        g["logic"] += [f["logic"]["max"]] if f["logic"] else []
        g["ratio"] += [f["precision"]["ratio"]] if f["precision"]["applies"] and f["precision"]["ratio"] is not None else []
    rows = [[b, path, ", ".join(map(str, g["batches"])), free_running(g["cases"], g["level"]),
             f"{max(g['logic']):.2g}" if g["logic"] else "—", f"{max(g['ratio']):.3f}x" if g["ratio"] else "—",
             f"`{worst(g['verdicts'])}`"] for (b, path), g in groups.items()]
    transport = [c for c in comparison["cells"] if c["backend"] == "host-staged vs collective"]
    if transport:
        rows.append(["host-staged vs collective", ", ".join(sorted({c["kernels"] for c in transport})),
                     ", ".join(map(str, sorted({c["batch"] for c in transport}))),
                     f"{sum(c['verdict'] == 'all_token_text_exact' for c in transport)}/{len(transport)} equal", "—", "—",
                     f"`{worst(c['verdict'] for c in transport)}`"])
    firsts = {(c["case"], str(c["first_divergence"])) for c in comparison["cells"] if c["first_divergence"]}
    engines = comparison.get("targets") or {}
    out = [f"### Parity (logic tolerance {comparison['logic_tolerance']:g} nats, precision bound "
           f"{comparison['precision_bound']:g}x, near-tie margin {comparison['near_tie_margin']:.3g})", "",
           _table(["backend", "path", "batches", "free-running", "logic max", "precision ratio", "verdict"], rows), ""]
    if firsts:
        out += [f"First divergences: {len(firsts)} distinct, each with its cells in `{DETAILS}`.", ""]
    if engines:
        out += [_table(["engine target", "kind", "level", "verdict", "not checked"],
                       [[f"`{n}`", t["kind"], t["level"], f"`{t['verdict']}`",
                         "; ".join(f"{k}: {v}" for k, v in t["not_checked"].items()) or "—"]
                        for n, t in engines.items()]), ""]
    if pairs := comparison.get("pairs"):
        out += ["Variant pairs: " + ", ".join(f"`{p['a']}` vs `{p['b']}` `{p['verdict']}`" for p in pairs) + ".", ""]
    return out


def _pivot(rows, key: str, figure) -> str:
    """One row a (name, prompts), one column a batch or concurrency `key`: a narrow table of `figure(row)`."""
    cols = sorted({int(getattr(r, key)) for r in rows})
    grid: dict[tuple, dict] = {}
    for r in rows:
        name = r.backend if key == "batch" else f"`{r.target}`"
        grid.setdefault((name, SHORT.get(r.prompts, str(r.prompts))), {})[int(getattr(r, key))] = figure(r)
    label = "b" if key == "batch" else "C="
    return _table(["", "prompts", *(f"{label}{c}" for c in cols)],
                  [[n, p, *(cells.get(c, "—") for c in cols)] for (n, p), cells in grid.items()])


def bench_brief(root: Path, frames) -> list[str]:
    """Each in-process cell's steady TPOT p50 and decode tok/s; against the baseline, the claims counted."""
    if frames is None:
        return []
    noisy = lambda r: " (noisy)" if r.noisy else ""  # noqa: E731
    floors = prefill_floors(_bench_cells(root))

    def figure(r) -> str:
        fl = floors.get((r.backend, r.prompts, int(r.batch)))
        return (f"{r.tpot_p50_ms:.2f} / {r.decode_tok_s:.0f}{noisy(r)}"
                + (f"; TTFT {fl['ttft_over_floor']:.1f}x floor" if fl else ""))

    out = ["### Decode benchmark, in process (steady TPOT p50 ms / decode tok/s"
           + ("; TTFT p50 over its prefill floor where the cell has one" if floors else "")
           + "; a noisy cell makes no claim)", "",
           _pivot(list(frames[0].itertuples(index=False)), "batch", figure), ""]
    baseline = read_json(root / layout.BASELINE)
    if baseline["baseline"]:
        claims: dict[str, int] = {}
        for c in baseline["cells"]:
            claims[c["claim"]] = claims.get(c["claim"], 0) + 1
        out += [f"Against baseline `{baseline['baseline']}`: "
                + ", ".join(f"{n} {claim}" for claim, n in claims.items()) + ".", ""]
    return out


def http_brief(frames) -> list[str]:
    """Each HTTP cell's TTFT and TPOT p50; the engine over HTTP beside itself in process, as one range."""
    from evident.workflow.bench.benchstats import known

    rows = frames and frames[1]
    if rows is None:
        return []
    figure = lambda r: ("refused" if known(r.refused) else  # noqa: E731
                        f"{r.ttft_p50_ms:.2f} / {r.tpot_p50_ms:.2f}" + (" (noisy)" if known(r.noisy) and r.noisy else ""))
    out = ["### Benchmark over HTTP (TTFT p50 / TPOT p50 ms, streaming /v1/completions)", "",
           _pivot(list(rows.itertuples(index=False)), "concurrency", figure), ""]
    ratios = [r.http_over_inprocess_tpot_p50 for r in rows.itertuples(index=False)
              if known(r.http_over_inprocess_tpot_p50)]
    if ratios:
        claims = [r.side_by_side_claim for r in rows.itertuples(index=False) if known(r.side_by_side_claim)]
        out += [f"The engine over HTTP / in process, TPOT p50: {min(ratios):.2f}–{max(ratios):.2f}x; "
                + ", ".join(f"{claims.count(c)} {c}" for c in dict.fromkeys(claims)) + ".", ""]
    return out


def profile_brief(root: Path) -> list[str]:
    """The profile capture in one line: the tool, and the top kernels' shares."""
    if not (root / layout.CAPTURE).is_file():
        return []
    cap = read_json(root / layout.CAPTURE)
    top = ", ".join(f"`{k['kernel'][:40]}` {k['share_pct']:.1f}%" for k in cap["top"][:3])
    return [f"Profile ({cap['tool']}, {cap['steps']} decode steps, batch {cap['batch']}): {cap['kernel_count']} "
            f"distinct kernels; top {top}.", ""]


def parity_headline(oracle: dict | None, comparison: dict | None, config: dict) -> list[str]:
    if comparison is None:
        return []
    # "transformers.DeepseekV2ForCausalLM (native, eager)" -> DeepseekV2
    family = oracle["implementation"].split()[0].split(".")[-1].removesuffix("ForCausalLM")
    engines = comparison.get("targets") or {}
    also = "".join(f", `{n}` ({t['kind']}, {t['level']} level)" for n, t in engines.items())
    return [f"Parity: the engine (`engine/`){also} against the Hugging Face transformers {family} oracle, greedy "
            f"decoding, {len(config['cases'])} cases.", ""]


def oracle_section(oracle: dict | None, comparison: dict | None, config: dict) -> list[str]:
    """The oracle's traces, then the parity table (oracle/hf.json, parity/comparison.json)."""
    if oracle is None:
        return []
    out = [
        "### Oracle traces",
        "",
        markdown(["case", "prompt tokens", "generated", "token_sha256", "text_sha256", "min top-1/top-2 margin"], [
            [c["name"], len(c["prompt_ids"]), len(c["generated_ids"]), f"`{c['token_sha256'][:16]}`",
             f"`{c['text_sha256'][:16]}`", f"{min(c['margins']):.3g}" if c["margins"] else "—"]
            for c in oracle["cases"]
        ]),
        "",
    ]
    if comparison is not None:
        out += parity_section(comparison, config["dtype"], oracle["reference"]["top_k"])
    return out


def parity_claims(oracle: dict | None, comparison: dict | None, config: dict, env: dict, ckpt: dict) -> list[str]:
    if comparison is None:
        return []
    top_k = oracle["reference"]["top_k"]
    return [
        f"- Shows: on this commit, config and checkpoint, the engine's greedy tokens and decoded text "
        f"{'equal' if comparison['verdict'] == 'all_token_text_exact' else 'compare as above with'} the transformers "
        f"implementation for every listed case and batch size ({', '.join(map(str, config['parity']['batch_sizes']))}), "
        f"on {env['device']} in {config['dtype']}.",
        f"- The logic check holds the engine's code, run in float32, to transformers' float32 along the oracle's traces: "
        f"within {comparison['logic_tolerance']:g} nats on every top-{top_k} log-prob of every "
        "position, every path and batch listed. It sees wrong maths (a constant, a mask, a routing choice); it does not "
        "see low-precision arithmetic (the float32 run takes the same kernels in float32) nor anything past the traces.",
        *([f"- Engine targets ({', '.join(f'`{n}`' for n in comparison['targets'])}) are held to the same oracle at the "
           "level listed: `token` compares ids as the engine's are; `text` compares completions as text only, and says "
           "nothing of the tokens behind them. Checks a target could not take are listed, never counted as passed."]
          if comparison.get("targets") else []),
        *([f"- The precision check holds the engine's {config['dtype']} error against the float32 oracle to at most "
           f"{comparison['precision_bound']:g}x transformers' own in {config['dtype']}, pooled over each cell's cases. "
           "It sees low-precision arithmetic that raises the error beyond that bound, not a smaller loss (the measured "
           "table in docs/campaigns.md, under Parity); it bounds no single position"
           + (", and on random weights both errors are tenths of a nat, which is why bf16 free-running traces part "
              "at near-ties." if ckpt["source"] == checkpoints.RANDOM else ".")]
          if config["dtype"] != "float32" else []),
    ]


def bench_section(root: Path, frames=None, config: dict | None = None) -> list[str]:
    """The in-process benchmark; `frames` (bench_frames) and `config` as render read them, else read here."""
    frames = frames or bench_frames(root)
    if frames is None:
        return []
    from evident.workflow.bench.benchstats import markdown_table

    cfg = (config or read_config(root / layout.CONFIG))["bench"]
    frame = frames[0]  # the HTTP rows: http_section
    cells = _bench_cells(root)
    out = [
        f"### Decode benchmark ({cfg['new_tokens']} new tokens, {cfg['warmup']} warm-up + {cfg['repeats']} measured "
        f"runs per cell; TPOT = steady decode interval after the first; engine decode path: {cfg.get('kernels', 'torch')})",
        "",
        *bench_contract_lines(cells, frame),
        markdown_table(frame),
        "",
        *bench_floor_lines(cells),
        *prefill_lines(cells),
        "![decode tok/s and TPOT against batch](plots/bench.png)",
        "",
    ]
    baseline = read_json(root / layout.BASELINE)
    if baseline["baseline"]:
        out += [f"Against baseline `{baseline['baseline']}`:", "", markdown(
            ["backend", "prompts", "batch", "claim", "TPOT p50 change", "reason"],
            [[c["backend"], SHORT.get(c.get("prompts", SAME), c.get("prompts")), c["batch"], c["claim"],
              "—" if c["tpot_p50_change_pct"] is None else f"{c['tpot_p50_change_pct']:+.1f}%", c["reason"] or ""]
             for c in baseline["cells"] if "backend" in c]), ""]
    return out


def bench_frames(root: Path):
    """summary.csv read once: (its in-process rows, its rows of the benchmark over HTTP or None where it has none), or
    None where the campaign wrote no summary.csv."""
    if not (root / layout.BENCH_TABLE).is_file():
        return None
    import pandas as pd

    from evident.workflow.bench.benchstats import by_transport

    inproc, http = by_transport(pd.read_csv(root / layout.BENCH_TABLE))
    return inproc, (http if len(http) else None)


def _ms(r, metric: str) -> str:
    return " / ".join(f"{getattr(r, f'{metric}_{q}_ms'):.2f}" for q in ("p50", "p95", "p99"))


def http_section(root: Path, frames=None, config: dict | None = None) -> list[str]:
    """The benchmark over HTTP: each cell's percentiles, then the builtin engine over HTTP beside it in process;
    `frames` and `config` as bench_section takes them."""
    from evident.workflow.bench.benchstats import known

    frames = frames or bench_frames(root)
    rows = frames and frames[1]
    if rows is None:
        return []
    cfg = (config or read_config(root / layout.CONFIG))["bench"]
    cells = [[f"`{r.target}`", SHORT.get(r.prompts, str(r.prompts)), str(int(r.concurrency)),
              *((_ms(r, m) for m in ("ttft", "tpot", "itl", "e2e")) if not known(r.refused) else
                [f"no figure: {r.refused}", "", "", ""]),
              f"{r.output_tok_s:.1f}" if known(r.output_tok_s) else "—",
              "—" if not known(r.noisy) else "yes" if r.noisy else "no"] for r in rows.itertuples(index=False)]
    out = [
        f"### Benchmark over HTTP (streaming /v1/completions; {cfg['new_tokens']} new tokens a request, "
        f"{cfg['warmup']} warm-up + {cfg['repeats']} measured rounds per cell of C requests sent at once)",
        "",
        markdown(["target", "prompts", "C", "TTFT ms p50 / p95 / p99", "TPOT ms p50 / p95 / p99",
                  "ITL ms p50 / p95 / p99", "E2E ms p50 / p95 / p99", "output tok/s", "noisy"], cells),
        "",
        "As vLLM's `bench serve` defines them, timed on the client: TTFT, request sent to its first streamed token; "
        "ITL, the intervals between its successive streamed events; TPOT, (E2E − TTFT) / (output tokens − 1), per "
        "request; E2E, request sent to its last token; output tok/s, every output token of a cell over its rounds' "
        "durations (first request sent to last stream ended). Noisy: the per-round TPOT medians spread more than "
        "5%, or fewer than 3 rounds (the in-process rule); a noisy cell makes no claim.",
        "",
    ]
    side = rows[rows["inprocess_cell"].notna() | rows["side_by_side_claim"].notna()]
    if len(side):
        fmt = lambda v: f"{v:.3f}" if known(v) else "—"  # noqa: E731
        out += ["The builtin engine in process and over HTTP (its cell of the single backend at batch = C, same "
                "decode path and prompts); ratios HTTP / in-process, TPOT: vLLM's per-request TPOT over the steady "
                "decode step; ITL p50 over the in-process steady TPOT p50, interval for interval:", "",
                markdown(["C", "prompts", "in process", "TPOT p50 ratio", "TTFT p50 ratio", "ITL p50 / TPOT p50",
                          "claim", "reason"],
                         [[str(int(r.concurrency)), SHORT.get(r.prompts, str(r.prompts)),
                           f"`{r.inprocess_cell}`" if known(r.inprocess_cell) else "—",
                           fmt(r.http_over_inprocess_tpot_p50), fmt(r.http_over_inprocess_ttft_p50),
                           fmt(r.http_itl_p50_over_inprocess_tpot_p50), str(r.side_by_side_claim),
                           r.side_by_side_reason if known(r.side_by_side_reason) else ""]
                          for r in side.itertuples(index=False)]), ""]
    baseline = read_json(root / layout.BASELINE)
    if against := [c for c in baseline["cells"] if "target" in c]:
        out += [f"Against baseline `{baseline['baseline']}`:", "", markdown(
            ["cell", "claim", "TPOT p50 change", "reason"],
            [[f"`{c['cell']}`", c["claim"],
              "—" if c["tpot_p50_change_pct"] is None else f"{c['tpot_p50_change_pct']:+.1f}%", c["reason"] or ""]
             for c in against]), ""]
    return out


def _bench_cells(root: Path) -> list[dict]:
    """The directory's bench cell records (bench/<cell>.json; summary.csv and baseline.json are not cells)."""
    cells = [read_json(p) for p in sorted((root / layout.BENCH).glob("*-b*.json"))]
    return [c for c in cells if isinstance(c, dict) and "backend" in c and "stats" in c]


def bench_contract_lines(cells: list[dict], frame) -> list[str]:
    """Which prompt contract each figure of the table is (its `prompts` column), with each contract's prompts and
    rows check, read from the cells."""
    out = []
    if (frame["prompts"] == SAME).any():
        n = sorted({c["contract"]["prompt_tokens"] for c in cells if cell_prompts(c) == SAME})
        out.append(f"- `same`: one prompt (`bench.prompt`, {', '.join(map(str, n))} tokens) copied to every row, so "
                   "every row routes to the same experts; a cell's rows must be identical on every run.")
    distinct = [c for c in cells if cell_prompts(c) == DISTINCT]
    if distinct:
        lengths = max((c["contract"]["prompt_tokens"] for c in distinct), key=len)
        checks: dict[str, list[str]] = {}
        for c in distinct:
            checks.setdefault(c["rows_check"]["verdict"], []).append(f"{c['backend']}-b{c['batch']}")
        verdicts = "; ".join(f"`{v}` " + ", ".join(where) for v, where in checks.items())
        out.append(f"- `distinct`: row r the prompt `bench.prompts[r]` ({', '.join(map(str, lengths))} tokens), so "
                   "rows route as a real batch does; each row checked against its prompt alone (a decisive "
                   f"difference writes no figure): {verdicts}.")
    return ["Prompt contracts:", "", *out, ""] if out else []


def bench_floor_lines(cells: list[dict]) -> list[str]:
    """How the floor column is made (workflow.floor.bench_floor), from the cells' own records."""
    floors = [c["floor"] for c in cells if c.get("floor")]
    if not floors:
        return []
    experts = next((f["unique_experts"] for f in floors if f.get("unique_experts")), None)
    bandwidths = sorted({round(f[floor.BANDWIDTH_KEY]) for f in floors})
    return [
        "Floor: per steady decode step, the bytes it must read (every weight once, each row's embedding row and "
        "cache at its own positions, and the routed experts the batch's rows chose, each once however many rows "
        "chose it: the experts actually chosen, from an untimed teacher-forced replay of each row), over the "
        f"read bandwidth each bench job measured ({', '.join(f'{b:,} GB/s' for b in bandwidths)}); "
        "the floor column is its mean over the steady steps, floor / TPOT p50 how near the cell comes to it"
        + (f". Unique experts a MoE layer: mean (min–max) over the steady steps and {experts['moe_layers']} MoE "
           f"layers, of {experts['experts']} routed experts, top-{experts['top_k']} a row (a same-prompt batch: "
           f"always {experts['top_k']})" if experts else "")
        + (". Expert-parallel cells: the busiest rank's (each rank reads the weights, the cache and its own shard's "
           "chosen experts)" if any(f.get("ranks", 1) > 1 for f in floors) else "")
        + (". The engine's graph path at batch 1 picks through the vocabulary projection's int8 screen: its floor "
           "counts the screen's bytes in place of that weight's" if any(f.get("vocabulary_screened") for f in floors)
           else "") + ".",
        "",
    ]


def audit_section(root: Path) -> list[str]:
    """The kernel resource audit (kernels/audit.json), one row per kernel over its specialisations."""
    if not (root / layout.AUDIT).is_file():
        return []
    audit = read_json(root / layout.AUDIT)
    out = ["### Kernel resource audit", ""]
    uncovered = [f"Not covered: {'; '.join(f'{k} ({why})' for k, why in audit['not_covered'].items())}.", ""] \
        if audit.get("not_covered") else []
    if not audit["kernels"]:
        return out + [f"Not compiled: {audit['reason']}.", ""] + uncovered
    rows = []
    for name in dict.fromkeys(r["kernel"] for r in audit["kernels"]):
        specs = [r for r in audit["kernels"] if r["kernel"] == name]
        regs = sorted({r["registers"] for r in specs})
        rows.append([f"`{name}`", len(specs), f"{regs[0]}–{regs[-1]}" if len(regs) > 1 else regs[0],
                     sum(r["spills"] for r in specs), max(r["shared_bytes"] for r in specs)])
    return out + [f"**Verdict: `{audit['verdict']}`** (a spill fails the gate).", "",
                  markdown(["kernel", "specialisations", "registers", "spills", "shared bytes"], rows), ""] + uncovered


def overlap_section(root: Path) -> list[str]:
    """The overlap A/B screens: with screens of the campaign's own (overlap/screens.json) a table of every screen's
    verdict, then each screen's section; else the built-in screen's (overlap/screen.json) alone."""
    builtin = screens.files(screens.BUILTIN)
    if (root / layout.SCREENS).is_file():
        index = read_json(root / layout.SCREENS)
        out = [f"### Overlap A/B screens: **`{index['verdict']}`**", "",
               f"{index['reason']}.", "",
               markdown(["screen", "factory", "bitwise equal", "verdict"], [
                   [f"`{e['name']}`", f"`{e['factory']}`",
                    "—" if e["inputs"] is None else f"{e['all_outputs_equal']}/{e['inputs']}", f"`{e['verdict']}`"]
                   for e in index["screens"]]), ""]
        return out + [line for e in index["screens"]
                      for line in screen_section(read_json(root / e["files"]["screen"]), e["files"]["plot"], "####")]
    if not (root / builtin["screen"]).is_file():
        return []
    return screen_section(read_json(root / builtin["screen"]), builtin["plot"])


def screen_section(s: dict, plot: str, level: str = "###") -> list[str]:
    """One screen (its screen.json) under a heading of `level`: bitwise counts, then medians per envelope and their
    plot, or why not; or why it was skipped."""
    name = s.get("name", screens.BUILTIN)  # a directory sealed before screens had names: the built-in's
    title = "Overlap A/B screen" if name == screens.BUILTIN else f"Overlap A/B screen `{name}`"
    if s.get("skipped"):
        # no image: the stage's plot of a skipped screen is a panel of the text above
        return [f"{level} {title} (skipped)", "", f"**Verdict: `{s['verdict']}`** — {s['verdict_reason']}.", ""]
    sh, bw, tm = s["shapes"], s["bitwise"], s["timing"]
    if sh:
        source = {"model": "shapes from the model", "campaign": "shapes stated by the campaign",
                  "cpu-small": "small interpreter shapes"}.get(sh["source"], f"{sh['source']} shapes")
        what = (f"K={sh['K']} → {'+'.join(map(str, sh['segments']))} ({'/'.join(sh['segment_dtypes'])}) beside a GEMM "
                f"K={sh['K']} → {sh['gemm_n']}, {sh['dtype']}; {source}")
    else:
        what = f"`{s['factory']}`; outputs " + ", ".join(
            f"{o['name']} {o['dtype']}{o['shape']}" for o in bw["outputs"])
    graph = ("" if bw["graph_equal_eager"] is None
             else f"; graph replay of A = eager A on {bw['graph_equal_eager']}/{bw['inputs']}")
    out = [
        f"{level} {title} ({what})",
        "",
        f"**Verdict: `{s['verdict']}`** — {s['verdict_reason']}.",
        "",
        f"- A: {s['variants']['A']}",
        f"- B: {s['variants']['B']}",
        "",
        f"Bitwise: every output of A and B equal on {bw['all_outputs_equal']}/{bw['inputs']} freshly drawn input "
        f"sets{graph}.",
        "",
    ]
    if not tm["measured"]:
        return out + [f"Timing not measured: {tm['reason']}.", ""]  # nothing timed, nothing to plot

    def cell(v: dict) -> str:
        return f"{v['median_us']:.2f} ({v['p10_us']:.2f}–{v['p90_us']:.2f})"

    out += [
        f"CUDA graph replays, {tm['trials']} trials per variant and envelope after {tm['warmup']} warm-up, A and B "
        f"interleaved; scrubbed = {tm['flush_bytes'] / 2**20:.0f} MiB written (≥ 2× L2) before each trial. "
        f"Claims need |B/A − 1| > {tm['noise'] * 100:g}% and neither variant noisy.",
        "",
        markdown(["envelope", "A median µs (p10–p90)", "B median µs (p10–p90)", "B/A", "claim", "reason"], [
            [env, cell(e["A"]), cell(e["B"]), f"{e['ratio_b_over_a']:.3f}", e["claim"], e["reason"] or ""]
            for env, e in tm["envelopes"].items()]),
        "",
        f"![overlap A/B timings]({plot})",
        "",
    ]
    return out


def quality_section(root: Path) -> list[str]:
    """The GSM8K quality gate (quality/gsm8k-*.json): per target correct/invalid, the verdict, flips."""
    if not (root / layout.QUALITY_GATE).is_file():
        return []
    g = read_json(root / layout.QUALITY_GATE)
    targets = sorted({g["reference"], *(x["candidate"] for x in g["gates"])})
    res = {t: read_json(root / layout.quality_result(t)) for t in targets}
    first = res[g["reference"]] if g["reference"] in res else next(iter(res.values()))
    c, d = first["contract"], first["data"]
    out = [
        f"### GSM8K quality gate ({c['limit']} test rows, {c['shots']} shots, greedy, max {c['max_tokens']} tokens, "
        f"stop {', '.join(f'`{s!r}`' for s in c['stop'])}, match `{c['match']}`)",
        "",
        f"**Quality verdict: `{g['verdict']}`**" + (" (advisory: the campaign does not fail on it)"
                                                  if g.get("advisory") and g["verdict"] != "pass" else "")
        + f" — {g['reason']}.",
        "",
    ]
    if g.get("note"):
        out += [f"Note: {g['note']}.", ""]
    out += [
        f"Data: test `{d['test']['name']}` ({d['test']['source']}, sha256 `{d['test']['sha256'][:16]}…`, "
        f"{d['test']['rows']} rows), train `{d['train']['name']}` (sha256 `{d['train']['sha256'][:16]}…`)"
        + (f". Generated by {d['test']['generator']} (seed {d['test']['seed']}): the test rows are its held-out split, "
           "which no training row of a trained checkpoint holds (the split is a hash of the question)."
           if d["test"]["source"] == "generated" else "."),
        "",
        markdown(["target", "correct", "accuracy", "invalid", "strict correct", "flexible correct", "seconds"], [
            [f"`{t}`" + (" (reference)" if t == g["reference"] else ""), f"{r['correct']}/{r['n']}",
             f"{r['accuracy']:.3f}", r["invalid"], r["by_match"]["strict"]["correct"],
             r["by_match"]["flexible"]["correct"], f"{r['seconds']:.1f}"] for t, r in res.items()]),
        "",
    ]
    for gate in g["gates"]:
        if gate.get("compared") is not None:
            out.append(f"- `{gate['candidate']}` against `{gate['reference']}`: `{gate['verdict']}`. Compared: "
                       f"{gate['compared']}. {gate['counts']}; flips (reference right, candidate wrong): "
                       + (", ".join(f"q{f['id']} ({f['reference']} → {f['candidate']}, gold {f['gold']})"
                                    for f in gate["flips"]) or "none")
                       + (f"; gains: {', '.join(f'q{i}' for i in gate['gains'])}" if gate["gains"] else ""))
        else:
            out.append(f"- `{gate['candidate']}` against `{gate['reference']}`: `{gate['verdict']}` ({gate['reason']})")
    return out + [""]


def floor_lines(fl: dict | None) -> list[str]:
    """The bytes a decode step must move against what its kernels took (profile/capture.json `floor`)."""
    if not fl:
        return []
    b = fl["bytes"]
    took = (f"; the captured steps' kernels took {fl['kernel_us_per_step']:.0f} µs a step, "
            f"{100 * fl['floor_fraction']:.0f}% of it the floor" if fl.get("floor_fraction") else "")
    screen = f"; {floor.SCREEN_READ}" if fl.get("vocabulary_screened") else ""
    return [f"Floor: a step must read {b['total'] / 1e6:.1f} MB (weights {b['weights'] / 1e6:.1f}, chosen routed "
            f"experts {b['chosen_experts'] / 1e6:.1f}, cache {b['cache'] / 1e6:.2f}{screen}); at the measured read "
            f"bandwidth of {fl[floor.BANDWIDTH_KEY]:.0f} GB/s that is {fl['floor_us']:.0f} µs{took}.", ""]


def profile_section(root: Path) -> list[str]:
    """The profile capture (profile/capture.json): which tool ran, why others did not, the top kernels."""
    if not (root / layout.CAPTURE).is_file():
        return []
    cap = read_json(root / layout.CAPTURE)
    steps = cap.get("step_us") or []
    med = sorted(steps)[len(steps) // 2] if steps else None
    out = [
        f"### Profile capture ({cap['tool']}, {cap['steps']} decode steps, batch {cap['batch']}, {cap['device']}"
        + (f", {cap['gpu']}" if cap.get("gpu") else "") + ")",
        "",
        f"Ran: `{cap['tool']}` ({cap['command']}). Not run: "
        + ("; ".join(f"{t}: {why}" for t, why in cap["not_run"].items()) or "—") + ".",
        "",
        f"{cap['kernel_count']} distinct kernels, {cap['launches']} launches; share = {cap['share_basis']}"
        + (f"; median decode step {med / 1e3:.2f} ms (wall, under the tool)" if med else "") + ".",
        "",
        *([f"Launches: {cap['launch']}.", ""] if cap.get("launch") else []),
        *floor_lines(cap.get("floor")),
        markdown(["kernel", "calls", "total µs", "mean µs", "share"], [
            [f"`{k['kernel'][:80]}`", k["calls"], f"{k['total_us']:.1f}", f"{k['mean_us']:.2f}", f"{k['share_pct']:.1f}%"]
            for k in cap["top"]]),
        "",
        "Full table: `profile/kernels.csv`" + ("; Chrome trace: `profile/trace.json.gz`" if cap["tool"] == "torch" else "")
        + ".",
        "",
        "![top kernels](plots/profile.png)",
        "",
    ]
    return out


# --- prefill floors, the rate rung and the soak (issue 66): files a directory sealed before them lacks -------------

def _n(v, fmt: str = ".2f", unit: str = "") -> str:
    """A figure, or — where the record has none (a rate where nothing completed, an older record)."""
    return "—" if v is None else f"{v:{fmt}}{unit}"


def prefill_floors(cells: list[dict]) -> dict[tuple, dict]:
    """Each in-process cell's `prefill_floor` by (backend, prompts, batch), summary.csv's key; a cell sealed before
    it has none."""
    return {(c["backend"], cell_prompts(c), int(c["batch"])): c["prefill_floor"] for c in cells
            if isinstance(c.get("prefill_floor"), dict) and c["prefill_floor"].get("ttft_over_floor") is not None}


def prefill_lines(cells: list[dict]) -> list[str]:
    """DETAILS.md's table of each cell's TTFT p50 against its prefill floor (workflow/bench/floor.py), — where a cell
    has none."""
    floors = prefill_floors(cells)
    if not floors:
        return []
    basis = min(floors.values(), key=lambda f: f.get("ranks", 1)).get("basis")  # one process's words, not a rank's
    rows = []
    for c in sorted(cells, key=lambda c: (c["backend"], cell_prompts(c) != SAME, int(c["batch"]))):
        fl = floors.get((c["backend"], cell_prompts(c), int(c["batch"])))
        ux = (fl or {}).get("unique_experts") or {}
        rows.append([c["backend"], SHORT.get(cell_prompts(c), cell_prompts(c)), c["batch"],
                     *(["—"] * 8 if not fl else [
                         fl.get("prompt_tokens", "—"), _n(fl.get("ttft_p50_ms"), ".3f"), _n(fl.get("floor_ms"), ".3f"),
                         fl.get("bound") or "—", _n(fl.get("ttft_over_floor"), ".1f", "x"),
                         _n((fl.get("bytes") or {}).get("total", 0) / 1e6, ".2f"), _n(fl.get("flops", 0) / 1e9, ".3f"),
                         f"{ux['mean']:.1f} ({ux['min']}–{ux['max']}) of {ux['experts']}" if ux else "—"])])
    return [f"Prefill floor (TTFT p50 against it): {basis}." if basis else "Prefill floor (TTFT p50 against it):", "",
            markdown(["backend", "prompts", "batch", "prompt tokens", "TTFT p50 (ms)", "prefill floor (ms)", "bound",
                      "TTFT / floor", "MB read", "GFLOP", "unique experts a MoE layer"], rows), ""]


def rate_cells(root: Path) -> list[dict]:
    """The directory's cells of the rate rung (bench/http-<target>-r<R>.json, runs.is_rate), in label order."""
    cells = [c for p in sorted(root.glob(layout.RATE_CELLS)) if is_rate(c := read_json(p))]
    return sorted(cells, key=lambda c: label_key(cell_label(c)))


def _slo(slo: dict | None) -> str:
    return f"TTFT ≤ {slo['ttft_ms']:g} ms and TPOT ≤ {slo['tpot_ms']:g} ms" if slo else "no SLO"


def _p(s: dict, metric: str, qs=("p50", "p99")) -> str:
    """A metric's percentiles `a / b` (ms), — where nothing completed."""
    m = s.get(metric)
    return " / ".join(f"{m[q]:.2f}" for q in qs) if isinstance(m, dict) else "—"


def _goodput(s: dict) -> str:
    return "—" if s.get("goodput") is None else f"{s['goodput']:.2f}/s ({s['good']}/{s['requests']})"


def rate_brief(cells: list[dict]) -> list[str]:
    """SUMMARY.md's rate rung: a row a target and rate, what completed, TTFT and TPOT, throughput and goodput."""
    if not cells:
        return []
    slos = list(dict.fromkeys(_slo((c.get("stats") or {}).get("slo")) for c in cells))
    rows = [[f"`{c['target']}`", f"{float(c['rate']):g}", f"{s.get('completed')}/{s.get('requests')}",
             _p(s, "ttft"), _p(s, "tpot"), _n(s.get("output_tok_s"), ".1f"), _goodput(s)]
            for c in cells for s in [c.get("stats") or {}]]
    return [f"### Benchmark over HTTP at request rates (Poisson arrivals; goodput under {' or '.join(slos)}; one run a "
            "rate: no noise estimate, no claim)", "",
            _table(["target", "rate /s", "completed", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "output tok/s",
                    "goodput (good)"], rows), ""]


def rate_section(root: Path, cells: list[dict]) -> list[str]:
    """DETAILS.md's rate rung: each target's contract, every figure of every rate, the failures, each target's plot."""
    if not cells:
        return []
    out = ["### Benchmark over HTTP at request rates (streaming /v1/completions at Poisson arrivals)", ""]
    for target in dict.fromkeys(c["target"] for c in cells):
        k = next(c.get("contract") or {} for c in cells if c["target"] == target)
        out.append(f"- `{target}`: {k.get('requests')} requests a rate at {k.get('arrivals')} arrivals (seed "
                   f"{k.get('seed')}), {k.get('new_tokens')} new tokens a request, prompt of {k.get('prompt_tokens')} "
                   f"tokens, request extras {', '.join(k.get('request_extras') or []) or 'none'}, ignore_eos "
                   f"{k.get('ignore_eos')}; goodput under {_slo(k.get('slo'))}.")
    rows = [[f"`{c['target']}`", f"{float(c['rate']):g}", f"{s.get('completed')}/{s.get('requests')}", s.get("failed"),
             _n(s.get("duration_s")), _n(s.get("request_throughput")), _n(s.get("output_tok_s"), ".1f"), _goodput(s),
             *(_p(s, m, ("p50", "p95", "p99")) for m in ("ttft", "tpot", "itl", "e2e"))]
            for c in cells for s in [c.get("stats") or {}]]
    out += ["", markdown(["target", "rate /s", "completed", "failed", "seconds", "requests/s", "output tok/s",
                          "goodput (good)", "TTFT ms p50 / p95 / p99", "TPOT ms p50 / p95 / p99",
                          "ITL ms p50 / p95 / p99", "E2E ms p50 / p95 / p99"], rows), "",
            "As vLLM's `bench serve --request-rate` reports them, timed on the client: the percentiles over the "
            "completed requests; requests/s, output tok/s and goodput (requests within every SLO bound) a second over "
            "the cell's duration, first request sent to last answer's end. A request that failed or cannot be "
            "measured completed nothing and misses the SLO. Each rate runs once: no repeats, so no noise estimate and "
            "no claim, here or against another directory (`evident diff` shows both figures and the ratio).", ""]
    for c in cells:
        if failures := (c.get("stats") or {}).get("failures"):
            out.append(f"- `{cell_label(c)}`: {len(failures)} failed; first: request {failures[0].get('request')}, "
                       f"{_oneline(failures[0].get('error'))[:300]}")
    if out[-1] != "":
        out.append("")
    for target in dict.fromkeys(c["target"] for c in cells):
        if (root / layout.rate_plot(target)).is_file():
            out += [f"![{target}: output tok/s and goodput against TPOT p50, a point a rate]({layout.rate_plot(target)})", ""]
    return out


def soak_records(root: Path) -> tuple[dict | None, list[dict]]:
    """soak/gate.json and each of its targets' records (None, [] where the soak did not run)."""
    gate = _read(root / layout.SOAK_GATE)
    if gate is None:
        return None, []
    return gate, [r for t in (gate.get("targets") or {}) if (r := _read(root / layout.soak_record(t)))]


def _died(r: dict) -> str:
    sv = r.get("server") or {}
    if sv.get("failed"):
        return "did not start"
    if sv.get("died"):
        return f"died at {_n(sv.get('at_s'), '.1f')} s (exit {sv.get('exit_code')})"
    return "ran throughout"


def _memory(m: dict | None) -> str:
    m = m or {}
    if m.get("growth_mb") is None:
        return "unknown"  # a url target's, or a server dead before its last third: why, in DETAILS.md
    return f"{m['growth_mb']:+.1f} MB ({m['growth']:+.1%})" + (" **flagged**" if m.get("flagged") else "")


def _drift(r: dict, metric: str = "tpot") -> str:
    ratio = ((r.get("latency") or {}).get("last_over_first") or {}).get(metric)
    return _n(ratio, ".2f", "x")


def _soak_contract(records: list[dict]) -> str:
    k = records[0].get("contract") or {} if records else {}
    return (f"{_n(k.get('duration_s'), 'g')} s at {_n(k.get('rate'), 'g')} requests/s, {k.get('arrivals')} arrivals, "
            f"seed {k.get('seed')}")


def soak_brief(root: Path) -> list[str]:
    """SUMMARY.md's soak: a row a target (requests, errors, its server's death, memory growth, TPOT drift), then
    why it fails."""
    gate, records = soak_records(root)
    if gate is None:
        return []
    rows = [[f"`{r['target']}`", f"{(c := r.get('counts') or {}).get('sent')}/{c.get('planned')}", c.get("errors"),
             _died(r), _memory(r.get("memory")), _drift(r)] for r in records]
    return [f"### Soak (`{gate['verdict']}`; {_soak_contract(records)})", "",
            _table(["target", "sent / planned", "errors", "server", "RSS growth", "TPOT p50 last / first"], rows), "",
            *[f"- {_oneline(why)}" for r in records for why in r.get("reasons") or []],
            *([""] if any(r.get("reasons") for r in records) else [])]


def soak_section(root: Path) -> list[str]:
    """DETAILS.md's soak: the verdict and rules, each target's requests, latency drift and memory, its errors and a
    dead server's last log lines."""
    gate, records = soak_records(root)
    if gate is None:
        return []
    out = [f"### Soak ({_soak_contract(records)})", "",
           f"**Verdict: `{gate['verdict']}`** — {gate.get('reason') or gate.get('verdict_reason') or '—'}.", "",
           *[f"- {what}: {rule}." for what, rule in (gate.get("rules") or {}).items()], ""]
    if not records:
        return out
    out += [markdown(["target", "kind", "server", "sent / planned", "unsent", "errors", "TTFT ms p50 / p99",
                      "TPOT ms p50 / p99", "output tok/s", "verdict"],
                     [[f"`{r['target']}`", f"{r.get('kind')} ({r.get('started')})", _died(r),
                       f"{c.get('sent')}/{c.get('planned')}", c.get("unsent"), c.get("errors"), _p(s, "ttft"),
                       _p(s, "tpot"), _n(s.get("output_tok_s"), ".1f"), f"`{r.get('verdict')}`"]
                      for r in records for c, s in [(r.get("counts") or {}, r.get("stats") or {})]]), ""]
    lat = [r for r in records if r.get("latency")]
    if lat:
        def window(r, metric):
            lt = r["latency"]
            a, b = (lt.get(w) or {} for w in ("first_p50_ms", "last_p50_ms"))
            return f"{_n(a.get(metric))} → {_n(b.get(metric))} ({_drift(r, metric)})"

        out += [f"Latency drift, p50 of the requests sent in each window (ms, last / first; recorded, not gated: two "
                f"windows of one soak hold no noise estimate). Windows: {lat[0]['latency'].get('rule')}.", "",
                markdown(["target", "first window", "last window", "TTFT", "TPOT", "E2E"],
                         [[f"`{r['target']}`", f"{r['latency'].get('first_requests')} requests",
                           f"{r['latency'].get('last_requests')} requests",
                           *(window(r, m) for m in ("ttft", "tpot", "e2e"))] for r in lat]), ""]
    out += ["Memory, the resident set of the server's process tree:", ""]
    for r in records:
        m = r.get("memory") or {}
        if not m.get("known"):
            out.append(f"- `{r['target']}`: {m.get('why') or 'unknown'}.")
            continue
        line = (f"- `{r['target']}`: growth unknown, {m.get('why')}" if m.get("growth_mb") is None else
                f"- `{r['target']}`: middle third {_n(m.get('middle_mb'), '.1f')} MB, last third "
                f"{_n(m.get('last_mb'), '.1f')} MB, growth {_memory(m)}")
        out.append(line + f"; over time (s: MB): {_samples(m.get('samples') or [])}.")
    out.append("")
    for r in records:
        c, sv = r.get("counts") or {}, r.get("server") or {}
        for e in c.get("error_samples") or []:
            out.append(f"- `{r['target']}` request {e.get('request')}: {_oneline(e.get('error'))[:300]}")
        if sv.get("failed"):
            out.append(f"- `{r['target']}` did not start: {_oneline(sv['failed'])}")
        if sv.get("log_tail"):
            out += ["", f"`{r['target']}` server log, its last {len(sv['log_tail'])} lines:", "",
                    *[f"- `{_oneline(line).replace('`', chr(39))}`" for line in sv["log_tail"] if line.strip()]]
    return out + ([""] if out[-1] != "" else [])


SAMPLES_SHOWN = 12  # memory samples a DETAILS.md line shows, evenly spaced (the record has them all)


def _samples(samples: list) -> str:
    if not samples:
        return "no sample"
    step = max(1, -(-len(samples) // SAMPLES_SHOWN))
    shown = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    return ", ".join(f"{round(t, 1):g}: {mb:.1f}" for t, mb in shown)


def rate_soak_boundary(rates: list[dict], root: Path) -> list[str]:
    """The claim boundary of the rate rung and the soak."""
    out = []
    if rates:
        out.append("- Rate figures: each rate ran once (its requests at seeded Poisson arrivals), so they carry no "
                   "noise estimate and make no claim; goodput counts the requests within every SLO bound.")
    if (root / layout.SOAK_GATE).is_file():
        out.append("- The soak gates errors, a server's death and memory growth over this soak's duration and rate "
                   "only; latency drift is recorded, not gated; a url target's memory is unknown, not 0.")
    return out
