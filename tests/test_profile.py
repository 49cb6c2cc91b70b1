"""The profile capture stage (workflow/stages/profile.py): tool choice and the ncu/nsys CSV parsers
(workflow/bench/profilers.py), the floor (workflow/bench/floor.py), and the CPU run through torch.profiler producing its kernel
table, plot, trace and SUMMARY section."""

from __future__ import annotations

import contextlib
import csv
import gzip
import json

import pytest
import tinyev
import torch

from evident.workflow.archive import summary
from evident.workflow.bench import floor, profilers
from evident.workflow.core.evidence import read_json
from evident.workflow.stages import profile

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("the CPU capture is tested on a machine without CUDA")
    cfg = tinyev.config(profile={"steps": 3})
    ckpt, ev = tinyev.make(tmp_path_factory.mktemp("profile"), cfg)
    cap = profile.run(ckpt, ev)
    return ev, cap


def test_cpu_capture_uses_torch_profiler_and_says_why_not_ncu(cpu_run):
    ev, cap = cpu_run
    c = read_json(ev / "profile/capture.json")
    assert c["tool"] == "torch" and c["device"] == "cpu" and len(c["step_us"]) == 3
    assert c["not_run"] == {"ncu": "no CUDA device: it profiles GPU kernels", "nsys": "no CUDA device: it profiles GPU kernels"}
    assert c["nvtx_ranges"] == ["prefill", "decode_step_0", "decode_step_1", "decode_step_2"]
    rec = read_json(ev / "stages/profile.json")
    assert rec["status"] == "ok" and rec["tags"]["profile.tool"] == "torch"
    assert {"plots/profile.png", "profile/capture.json", "profile/kernels.csv", "profile/trace.json.gz"} <= set(rec["files"])


def test_kernel_table(cpu_run):
    ev, _ = cpu_run
    rows = list(csv.DictReader((ev / "profile/kernels.csv").open()))
    assert list(rows[0]) == profile.CSV_HEADER and any(r["kernel"] in ("aten::mm", "aten::addmm", "aten::bmm") for r in rows)
    totals = [float(r["total_us"]) for r in rows]
    assert totals == sorted(totals, reverse=True) and all(int(r["calls"]) >= 1 for r in rows)
    assert 0 < sum(float(r["share_pct"]) for r in rows) <= 100.5  # self times within the steps' wall time
    for r in rows:
        # the CSV rounds the mean to 3 decimals: calls x 0.0005 µs of rounding
        assert abs(float(r["mean_us"]) * int(r["calls"]) - float(r["total_us"])) < 0.0005 * int(r["calls"]) + 0.01
    assert (ev / "plots/profile.png").read_bytes().startswith(PNG)


def test_trace_is_a_chrome_trace_without_paths(cpu_run):
    ev, _ = cpu_run
    raw = gzip.decompress((ev / "profile/trace.json.gz").read_bytes())
    trace = json.loads(raw)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"prefill", "decode_step_0"} <= names
    assert str(tinyev.REPO).encode() not in raw and b"/home/" not in raw


def test_summary_section(cpu_run):
    ev, _ = cpu_run
    text = "\n".join(summary.profile_section(ev))
    assert "### Profile capture (torch, 3 decode steps" in text and "ncu: no CUDA device" in text
    assert "profile/kernels.csv" in text and "plots/profile.png" in text
    assert f"Launches: {profilers.LAUNCH}." in text  # the captured kernels' durations are their own, without PDL


def test_ranges_cover_exactly_the_decode_steps(tmp_path, monkeypatch):
    """The workload is engine.generate: its prefill (one forward of every row) inside `prefill`, then the CUDA profiler
    range opened before the first decode step and closed after the last, one forward per `decode_step_<i>`."""
    from evident.engine.checkpoint import load_model

    ckpt, _ = tinyev.make(tmp_path, tinyev.config())
    model = load_model(ckpt)
    log = []

    @contextlib.contextmanager
    def marker(name, cuda):
        log.append(name)
        yield
        log.append("/" + name)

    monkeypatch.setattr(profilers, "marker", marker)
    monkeypatch.setattr(profilers.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(profilers.torch.cuda.profiler, "start", lambda: log.append("start"))
    monkeypatch.setattr(profilers.torch.cuda.profiler, "stop", lambda: log.append("stop"))
    model.register_forward_hook(lambda *_: log.append("forward"))
    times = profilers.decode_steps(model, [5, 6, 7], batch=2, steps=3, cuda=False, profiled=True)
    steps = [x for i in range(3) for x in (f"decode_step_{i}", "forward", f"/decode_step_{i}")]
    assert log == ["prefill", "forward", "/prefill", "start", *steps, "stop"]
    assert len(times) == 3 and all(t > 0 for t in times)


def test_tool_choice(monkeypatch):
    monkeypatch.setattr(profilers.shutil, "which", lambda t: f"/usr/bin/{t}" if t == "nsys" else None)
    order, why = profilers.choose("auto", cuda=True)
    assert order == ["nsys", "torch"] and why == {"ncu": "not found on PATH"}
    with pytest.raises(RuntimeError, match="profile.tool is ncu but it cannot run here: not found on PATH"):
        profilers.choose("ncu", cuda=True)
    order, why = profilers.choose("torch", cuda=True)
    assert order == ["torch"] and set(why) == {"ncu", "nsys"}


def test_ncu_and_nsys_csv_parsers():
    ncu = ('==PROF== Disconnected\n"ID","Process ID","Host Name","Kernel Name","gpu__time_duration.sum"\n'
           '"","","","","usecond"\n"0","1","h","gemv","2.50"\n"1","1","h","argmax","1.00"\n"2","1","h","gemv","3.50"\n')
    launches = profilers.parse_ncu_csv(ncu)
    assert launches == [("gemv", 2.5), ("argmax", 1.0), ("gemv", 3.5)]
    t = profilers.table(launches)
    assert t[0] == {"kernel": "gemv", "calls": 2, "total_us": 6.0, "mean_us": 3.0, "share_pct": pytest.approx(100 * 6 / 7)}
    nsys = ('"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)","Name"\n'
            '"60.0","3000","3","1000.0","1000.0","900","1100","10.0","gemv"\n'
            '"40.0","2000","1","2000.0","2000.0","2000","2000","0.0","argmax"\n')
    t = profilers.table(rows=profilers.parse_nsys_csv(nsys))
    assert [(k["kernel"], k["calls"], k["total_us"]) for k in t] == [("gemv", 3, 3.0), ("argmax", 1, 2.0)]


def test_floor_counts_what_a_step_must_read(cpu_run):
    ev, _ = cpu_run
    fl = read_json(ev / "profile/capture.json")["floor"]
    b = fl["bytes"]
    assert b["total"] == b["weights"] + b["chosen_experts"] + b["embedding_rows"] + b["cache"] > 0
    assert fl["floor_us"] == pytest.approx(b["total"] / (fl[floor.BANDWIDTH_KEY] * 1e9) * 1e6)
    assert fl[floor.BANDWIDTH_KEY] > 0 and fl["kernel_us_per_step"] is None  # no GPU kernels on a CPU
    assert fl["vocabulary_screened"] is False  # the torch path reads the projection's weight
    text = "\n".join(summary.profile_section(ev))
    assert f"a step must read {b['total'] / 1e6:.1f} MB" in text and "int8 screen" not in text


def test_floor_counts_the_screen_where_the_captured_steps_picked_through_it(tmp_path):
    """The graph path's steps at one row, asked for no logits, pick through the vocabulary projection's int8 screen
    (engine.graph_decode.screened): the floor counts the screen's bytes in place of the projection's weight. On the
    GPU where there is one (the kernels run through Triton's interpreter only on a machine without one: conftest sets
    it there, and the stage refuses a CPU run of the graph path without it)."""
    from evident.workflow.models.checkpoints import DTYPES

    # torch.profiler on the GPU too: the floor is under test, not the tools (ncu, nsys: test_tool_choice)
    device, tool = ("cuda", "torch") if torch.cuda.is_available() else ("cpu", "auto")
    cfg = tinyev.config(device=device, profile={"steps": 2, "batch": 1, "tool": tool},
                        bench={**tinyev.config()["bench"], "kernels": "graph"})
    ckpt, ev = tinyev.make(tmp_path, cfg)
    profile.run(ckpt, ev)
    c = read_json(ev / "profile/capture.json")
    dtype = DTYPES[cfg["dtype"]]
    lay, whole = floor.layout(ckpt, dtype), floor.step_bytes(ckpt, dtype, 1, c["prompt_tokens"] + 1)
    assert c["floor"]["vocabulary_screened"] and lay.head > lay.screen > 0
    assert c["floor"]["bytes"]["total"] == whole["total"] - (lay.head - lay.screen)
    assert "int8 screen" in c["floor"]["basis"] and "int8 screen" in "\n".join(summary.profile_section(ev))


def test_step_bytes_against_a_loaded_model(tmp_path):
    """Weights as the engine loads them (real tensors, router gates fp32), counted independently of the meta
    model: everything but the routed experts and the embedding table, then top_k experts a MoE layer."""
    from evident.engine.checkpoint import load_model
    from evident.engine.model import MoE

    cfg = tinyev.config()
    ckpt, _ = tinyev.make(tmp_path, cfg)
    model = load_model(ckpt, dtype=torch.bfloat16)
    a = model.args
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    moes = [l.mlp for l in model.layers if isinstance(l.mlp, MoE)]
    assert moes, "the tiny campaign model has MoE layers"
    routed = {id(p) for m in moes for p in m.experts.parameters()}
    others = [p for n, p in model.named_parameters() if id(p) not in routed and n != "embed_tokens.weight"]
    expert = nbytes(next(iter(moes[0].experts.values())).parameters())
    got = floor.step_bytes(ckpt, torch.bfloat16, batch=3, positions=7)
    assert got["weights"] == nbytes(others)
    assert got["chosen_experts"] == len(moes) * a.num_experts_per_tok * expert
    assert got["cache"] == a.num_hidden_layers * 3 * 7 * (a.kv_lora_rank + a.qk_rope_head_dim) * 2
    assert got["embedding_rows"] == 3 * a.hidden_size * 2
