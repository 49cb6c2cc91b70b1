"""Engine targets under the parity gate (workflow/plan/targets.py, workflow/stages/parity_target.py, compare): the builtin
engine through its own server (token level, teacher-forced through echo), a `command` target (tests/command_engine.py),
`transformers serve` (a server nobody here wrote: text level), each correct and, where it can be, with a known engine
bug (tests/mutants.py); a malformed trace, text-level divergences and bad `engines:` entries refused before any work.
One oracle on the random-weight tiny model is shared; each target runs the parity_target stage on it."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import re
from pathlib import Path

import mutants
import pytest
import tinyev
import yaml
from campaigns import overridden, rejected

from evident.workflow.core.evidence import read_json
from evident.workflow.core.verdicts import DEFECTS
from evident.workflow.plan import targets
from evident.workflow.stages import compare, parity_target

REPO = Path(__file__).resolve().parents[1]
PARITY = {**tinyev.defaults(yaml.safe_load((REPO / "config/schema.yaml").read_text())["properties"]["parity"]),
          "batch_sizes": [1, 2]}
CASES = [{"name": "greeting", "prompt": "Hello, evident! The engine says", "max_new_tokens": 12},
         {"name": "arithmetic", "prompt": "Question: what is 12 + 30?\nAnswer:", "max_new_tokens": 12}]
SERVE = "{python} -m evident.engine.serve --checkpoint {checkpoint} --dtype {dtype} --device {device} --port {port}"
COMMAND = f"{{python}} {REPO / 'tests/command_engine.py'} --checkpoint {{checkpoint}} --dtype {{dtype}} {{request}} {{out}}"
# transformers' own OpenAI-compatible server, as its `transformers` console script runs it
TRANSFORMERS_SERVE = ("{python} -m transformers.cli.transformers serve {checkpoint} --host 127.0.0.1 --port {port} "
                      "--device {device} --dtype {dtype}")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """(root, checkpoint, evidence dir, oracle document): the oracle's traces every target is held to."""
    from evident.workflow.stages import oracle

    root = tmp_path_factory.mktemp("targets")
    ckpt, ev = tinyev.make(root, tinyev.config(parity=PARITY, cases=CASES))
    oracle.main(["--checkpoint", str(ckpt), "--evidence", str(ev)])
    return root, ckpt, ev, read_json(ev / "oracle/hf.json")


@contextlib.contextmanager
def engine_on_path(root: Path, mutant: str | None):
    """The engine package that subprocesses import, first on PYTHONPATH: this tree's, or a scratch copy with `mutant`
    applied."""
    src = REPO if mutant is None else root / f"src-{mutant}"
    if not src.exists():
        mutants.scratch(src, mutant)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), str(REPO), old]))
    try:
        yield
    finally:
        os.environ.pop("PYTHONPATH") if old is None else os.environ.__setitem__("PYTHONPATH", old)


def held(shared, spec: dict, batch_sizes=(1, 2)) -> dict:
    """The target's parity run (the stage, on the shared oracle) and its comparison."""
    _, ckpt, ev, oracle = shared
    parity_target.run(ckpt, ev, spec, list(batch_sizes))
    return compare.compare(oracle, [read_json(ev / f"parity/{spec['name']}-b{b}.json") for b in batch_sizes])


def cells(result: dict) -> list[tuple]:
    return sorted((c["batch"], c["case"], c["verdict"], c["level"]) for c in result["cells"])


# --- the builtin engine through its own server, as an openai target -----------------------------------------------

@pytest.fixture(scope="module")
def served(shared):
    with engine_on_path(shared[0], None):  # the tree's engine, whatever the working directory
        return held(shared, {"name": "engine-served", "kind": "openai", "serve": {"command": SERVE}})


def test_the_engine_served_is_token_exact_and_teacher_forced(served, shared):
    assert served["verdict"] == "all_token_text_exact", served["first_divergence"]
    assert cells(served) == [(b, c["name"], "all_token_text_exact", "token") for b in (1, 2)
                             for c in sorted(CASES, key=lambda c: c["name"])]
    t = served["targets"]["engine-served"]
    assert (t["kind"], t["level"], t["verdict"]) == ("openai", "token", "all_token_text_exact")
    assert "logic" not in t["not_checked"]  # echo gave the float32 forced run: the logic check ran
    assert all(f["logic"]["max"] < PARITY["logic_tolerance"] and f["logic"]["top1_agreement"] == 1.0
               for f in served["forced"])
    run = read_json(shared[2] / "parity/engine-served-b2.json")
    assert run["target"]["offers"]["echo"] and run["target"]["offers"]["logprobs"] >= PARITY["top_k"]
    assert all(len(c["rows"]) == 2 and c["forced"]["float32"]["rows"][1]["bounded"] == 0 for c in run["cases"])
    assert (shared[2] / "logs/parity-engine-served-server.log").is_file()


def test_a_served_engine_bug_is_an_accuracy_gap_at_token_level(shared):
    root, ckpt, _, _ = shared
    with mutants.serve(root / "served-mutant", "route_drop_smallest", ckpt, "float32") as url:
        result = held(shared, {"name": "mutant-served", "kind": "openai", "url": url}, (1,))
    assert result["verdict"] == "engine_accuracy_gap" and result["verdict"] in DEFECTS
    assert result["targets"]["mutant-served"]["level"] == "token"
    assert any(c["logic"] and not c["logic"]["pass"] for c in result["cells"])  # the forced check sees it


@pytest.fixture(scope="module")
def shared_bf16(tmp_path_factory):
    """`shared` in a bf16 campaign: the oracle in bf16 beside its float32 reference."""
    from evident.workflow.stages import oracle

    root = tmp_path_factory.mktemp("targets-bf16")
    ckpt, ev = tinyev.make(root, tinyev.config(dtype="bfloat16", parity=PARITY, cases=CASES))
    oracle.main(["--checkpoint", str(ckpt), "--evidence", str(ev)])
    return root, ckpt, ev, read_json(ev / "oracle/hf.json")


def test_a_bf16_served_engine_is_held_by_the_precision_check(shared_bf16):
    """A server in a bf16 campaign computes in bf16: its echoed log-probs cannot feed the float32 logic check (recorded
    as not checked), so the precision check decides. The engine served clean passes it; with a routing bug it fails."""
    root, ckpt, _, _ = shared_bf16
    with mutants.serving({"clean": (root / "clean", None, ckpt, "bfloat16"),
                          "bug": (root / "bug", "route_drop_smallest", ckpt, "bfloat16")}) as urls:
        clean = held(shared_bf16, {"name": "clean-served", "kind": "openai", "url": urls["clean"]}, (1,))
        bug = held(shared_bf16, {"name": "bug-served", "kind": "openai", "url": urls["bug"]}, (1,))
    for result, name in ((clean, "clean-served"), (bug, "bug-served")):
        assert result["targets"][name]["level"] == "token" and "logic" in result["targets"][name]["not_checked"]
        assert result["forced"][0]["precision"]["applies"]
    assert clean["verdict"] not in DEFECTS and clean["forced"][0]["precision"]["pass"], clean["first_divergence"]
    assert bug["verdict"] in DEFECTS and not bug["forced"][0]["precision"]["pass"]
    assert bug["forced"][0]["precision"]["ratio"] > 2 * clean["forced"][0]["precision"]["ratio"]
    print(f"\nbf16 served: clean {clean['verdict']} ratio {clean['forced'][0]['precision']['ratio']:.3f}, "
          f"route_drop_smallest {bug['verdict']} ratio {bug['forced'][0]['precision']['ratio']:.3f}")


# --- a command target --------------------------------------------------------------------------------------------

def test_a_command_target_passes_and_its_engine_bug_fails(shared):
    root = shared[0]
    with engine_on_path(root, None):
        good = held(shared, {"name": "engine-command", "kind": "command", "command": COMMAND}, (2,))
    with engine_on_path(root, "softmax_scale_x1.01"):
        bad = held(shared, {"name": "mutant-command", "kind": "command", "command": COMMAND}, (2,))
    assert good["verdict"] == "all_token_text_exact" and good["targets"]["engine-command"]["level"] == "token"
    assert good["forced"][0]["logic"]["max"] < PARITY["logic_tolerance"]
    assert bad["verdict"] == "engine_accuracy_gap"
    assert bad["forced"][0]["logic"]["max"] > PARITY["logic_tolerance"]
    request = read_json(shared[2] / "logs/parity-engine-command/request-b2.json")
    assert request["batch"] == 2 and [c["name"] for c in request["cases"]] == [c["name"] for c in CASES]


def test_a_malformed_trace_is_an_error_naming_the_field(shared):
    _, ckpt, ev, _ = shared
    spec = {"name": "broken", "kind": "command", "command": COMMAND + " --malformed"}
    with pytest.raises(targets.TraceError, match=r"`cases\.0\.rows\.0\.generated_ids\.0`: 'seven' is not of type 'integer'"):
        parity_target.run(ckpt, ev, spec, [1])
    assert not (ev / "parity/broken-b1.json").exists()
    assert read_json(ev / "stages/parity-broken.json")["status"] == "failed"


def test_a_trace_that_does_not_answer_its_request_is_refused():
    request = {"batch": 2, "cases": [{"name": "a", "score_ids": [[1, 2], [3, 4]]}]}
    with pytest.raises(targets.TraceError, match=r"`cases\.0\.rows`: 1 rows, the request's batch is 2"):
        targets.check_trace({"cases": [{"name": "a", "rows": [{"generated_ids": [1]}]}]}, request, "t")
    row = {"top_ids": [[1], [3]], "top_logprobs": [[-1.0], [-1.0]], "score_logprobs": [[-1.0, -2.0], [-1.0]]}
    trace = {"cases": [{"name": "a", "rows": [{"generated_ids": [1]}] * 2, "forced_rows": [row, row]}]}
    with pytest.raises(targets.TraceError, match=r"`cases\.0\.forced_rows\.0\.score_logprobs\.1`: 1 log-probs"):
        targets.check_trace(trace, request, "t")


# --- transformers serve: text level ------------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="transformers serve places the model with accelerate (the `test` extra)")
def test_transformers_serve_is_compared_at_text_level(shared, monkeypatch):
    """Through its recipe (workflow/plan/recipes.py `transformers`), as a campaign's one line runs it."""
    from evident.workflow.plan import recipes

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = {"dtype": "float32", "engines": [{"name": "transformers-serve", "recipe": "transformers"}]}
    recipes.expand(cfg, {"max_position_embeddings": 256})
    assert cfg["engines"][0]["serve"]["command"].split()[:4] == TRANSFORMERS_SERVE.split()[:4]
    result = held(shared, cfg["engines"][0])
    t = result["targets"]["transformers-serve"]
    assert (t["level"], t["verdict"], result["verdict"]) == ("text", "text_only", "text_only")
    assert set(t["not_checked"]) == {"logic", "precision"}
    assert not any(c["verdict"] == "all_token_text_exact" for c in result["cells"])  # never reported as exact
    assert "text_only" not in DEFECTS


def text_run(oracle: dict, texts: list[str]) -> dict:
    """A text-level target's run of the oracle's first case, rows `texts`, as the stage records it."""
    from evident.workflow.core.evidence import text_sha256
    from evident.workflow.parity.traces import first_row_mismatch

    case = oracle["cases"][0]
    m = first_row_mismatch(texts)
    return {"backend": "t", "kernels": "openai", "batch": len(texts), "target": {
        "name": "t", "kind": "openai", "level": "text", "dtype": "float32"}, "cases": [
        {"name": case["name"], "prompt_ids": None, "rows_identical": m is None, "first_row_mismatch": m,
         "rows": [{"text": t, "text_sha256": text_sha256(t)} for t in texts]}]}


def test_text_level_divergences_get_the_margin_rule_and_rows_must_agree(shared):
    oracle = copy.deepcopy(shared[3])
    oracle["cases"] = oracle["cases"][:1]
    want = oracle["cases"][0]["served_text"]
    assert compare.compare(oracle, [text_run(oracle, [want, want])])["verdict"] == "text_only"
    ends = oracle["cases"][0]["served_text_ends"]
    cut = ends[3]  # the text of the first four tokens, then another character
    wrong = want[:cut] + ("#" if want[cut:cut + 1] != "#" else "%")
    r = compare.compare(oracle, [text_run(oracle, [wrong])])
    d = r["first_divergence"]
    assert r["verdict"] in ("engine_accuracy_gap", "near_tie_divergence") and d["char"] == cut and d["level"] == "text"
    assert d["step"] == next(i for i, e in enumerate(ends) if e > cut)
    assert r["verdict"] == ("near_tie_divergence" if d["oracle_margin"] < r["near_tie_margin"] else "engine_accuracy_gap")
    r = compare.compare(oracle, [text_run(oracle, [want, wrong])])
    assert r["verdict"] == "batch_row_mismatch" and r["first_divergence"]["char"] == cut


def test_a_missing_top_id_is_bounded_not_guessed():
    reference = {"top_ids": [[5, 6, 7]], "top_logprobs": [[-0.5, -1.0, -9.0]]}
    row = parity_target.forced_row(reference, [[(5, -0.5), (6, -1.2)]])  # 7 unlisted: at most -1.2
    assert row["ref_logprobs"] == [[-0.5, -1.2, -9.0]] and row["bounded"] == 1  # -9 is within the bound: no error
    row = parity_target.forced_row({"top_ids": [[5, 7]], "top_logprobs": [[-0.5, -0.9]]}, [[(5, -0.5), (6, -1.2)]])
    assert row["ref_logprobs"] == [[-0.5, -1.2]]  # 7 had -0.9 in the oracle and is below -1.2 here: an error >= 0.3


# --- bad input, refused before any work -------------------------------------------------------------------------

BASE = yaml.safe_load((REPO / "config/config.yaml").read_text())


def with_engines(*entries, **over) -> dict:
    return overridden(BASE, engines=list(entries), **over)


@pytest.mark.parametrize("entry, where, why", [
    ({"name": "x", "kind": "vllm", "url": "http://127.0.0.1:1/v1"}, "engines.0.kind", "is not one of"),
    ({"name": "x", "kind": "openai"}, "engines.0", "needs either `url`"),
    ({"name": "x", "kind": "openai", "url": "http://127.0.0.1:1/v1", "serve": {"command": SERVE}}, "engines.0", "not both"),
    ({"name": "x", "kind": "openai", "url": "ftp://127.0.0.1/v1"}, "engines.0.url", "does not match"),
    ({"name": "x", "kind": "command"}, "engines.0", "needs `command`"),
    ({"name": "x", "kind": "command", "command": "{python} run.py {request}"}, "engines.0.command", "needs {out}"),
    ({"name": "x", "kind": "command", "command": "{python} run.py {request} {out} {model}"}, "engines.0.command",
     "unknown placeholder(s) {model}"),
    ({"name": "x", "kind": "command", "command": "no-such-engine-binary {request} {out}"}, "engines.0.command",
     "'no-such-engine-binary' is not on PATH"),
    ({"name": "x", "kind": "openai", "serve": {"command": "{python} -m evident.engine.serve"}}, "engines.0.serve.command",
     "needs {port}"),
    ({"name": "single-triton", "kind": "command", "command": COMMAND}, "engines.0.name", "builtin engine's runs"),
    ({"name": "hf", "kind": "command", "command": COMMAND}, "engines.0.name", "choose another"),
    ({"name": "x", "kind": "builtin"}, "engines.0.kind", "always runs"),
])
def test_a_bad_engine_entry_is_refused_naming_it(entry, where, why):
    err = rejected(with_engines(entry))
    assert f"`{where}`" in err and why in err, err


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """Servers started together (tests/mutants.py serving) each need their own port, even where the OS gives a probe
    socket's port again before the first server binds it (seen: two mutant servers on one port)."""
    import socket

    given = iter([40001, 40001, 40002])

    class Probe:
        def __init__(self, *a): self.port = next(given)
        def __enter__(self): return self
        def __exit__(self, *a): return False
        def bind(self, addr): pass
        def getsockname(self): return ("127.0.0.1", self.port)

    monkeypatch.setattr(targets, "_HANDED_OUT", set())
    monkeypatch.setattr(targets, "ephemeral_ports", lambda: range(0))  # unknown: the OS's bind(0)
    monkeypatch.setattr(socket, "socket", Probe)
    assert [targets.free_port(), targets.free_port()] == [40001, 40002]


def test_free_ports_lie_below_the_range_client_connections_take(monkeypatch, tmp_path):
    """A port in the OS's ephemeral range can be taken by a client connection's own end before the server binds it
    (seen: a mutant server's port in use while ten servers were polled for readiness); free_port picks below that
    range, skips a port something is bound to, and hands out each once."""
    from types import SimpleNamespace

    table = tmp_path / "ip_local_port_range"
    table.write_text("32768\t60999\n")
    monkeypatch.setattr(targets, "EPHEMERAL_RANGE", table)
    monkeypatch.setattr(targets, "_HANDED_OUT", set())
    assert targets.ephemeral_ports() == range(32768, 61000)
    ports = [targets.free_port() for _ in range(20)]
    assert len(set(ports)) == 20 and all(12768 <= p < 32768 for p in ports), ports

    picks = iter([20000, 20001, 20001, 20002])  # bound by something else, free, handed out already, free
    monkeypatch.setattr(targets, "_PICK", SimpleNamespace(randrange=lambda lo, hi: next(picks)))
    monkeypatch.setattr(targets, "port_free", lambda port: port != 20000)
    assert [targets.free_port(), targets.free_port()] == [20001, 20002]


def test_an_unreachable_url_is_refused_before_work():
    port = targets.free_port()  # nothing listens there
    err = rejected(with_engines({"name": "remote", "kind": "openai", "url": f"http://127.0.0.1:{port}/v1"}))
    assert "`engines.0.url`" in err and "GET <url>/models failed" in err and "EVIDENT_SKIP_ENDPOINT_CHECK" in err


def test_quality_takes_openai_targets_by_name_only():
    cmd = {"name": "mine", "kind": "command", "command": COMMAND}
    err = rejected(with_engines(cmd, **{"quality.targets": ["hf", "mine"]}))
    assert "`quality.targets.1`" in err and "a command target runs parity only" in err
    err = rejected(with_engines(cmd, **{"quality.targets": ["hf", "mien"]}))
    assert "did you mean 'mine'" in err


def test_the_evidence_config_records_no_url_and_no_absolute_path():
    from evident.workflow.plan.campaign import evidence_config

    cfg = with_engines({"name": "remote", "kind": "openai", "url": "http://user:secret@10.0.0.1:8000/v1"},
                       {"name": "mine", "kind": "command", "command": "/home/someone/bin/eng --in {request} {out}"})
    recorded = yaml.safe_dump(evidence_config(cfg))
    assert "secret" not in recorded and "10.0.0.1" not in recorded and "/home/someone" not in recorded
    assert "<path>/eng#" in recorded and "--in {request} {out}" in recorded


def test_summary_shows_each_target_with_its_verdict_and_level(served, shared):
    from evident.workflow.archive.summary import parity_section

    oracle = copy.deepcopy(shared[3])
    oracle["cases"] = oracle["cases"][:1]
    token = read_json(shared[2] / "parity/engine-served-b1.json")
    token["cases"] = token["cases"][:1]
    text = text_run(oracle, [oracle["cases"][0]["served_text"]])
    lines = re.sub(" +", " ", "\n".join(parity_section(compare.compare(oracle, [token, text]), "float32", PARITY["top_k"])))
    assert "| engine-served | openai, token level | 1 | 1/1 exact |" in lines
    assert "| t | openai, text level | 1 | text: 1/1 equal | — (text level: no log-probs) |" in lines
    assert "| `engine-served` | openai | token | float32 | `all_token_text_exact` |" in lines
    assert "| `t` | openai | text | float32 | `text_only` | logic: text level: no log-probs;" in lines


def test_a_served_process_is_polled_until_ready_and_always_stopped(tmp_path):
    import sys
    import urllib.request

    port = targets.free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with pytest.raises(RuntimeError, match="boom"):
        with targets.served(argv, port, tmp_path / "logs/a.log", "a test server", ready="/") as (base, _):
            assert base == f"http://127.0.0.1:{port}/v1" and urllib.request.urlopen(f"http://127.0.0.1:{port}/").status == 200
            raise RuntimeError("boom")  # a stage that fails: its server is stopped all the same
    assert targets.port_free(port)
    with pytest.raises(targets.TargetError, match=r"a test server exited with 3 before it was ready \(see logs/b.log\)"):
        with targets.served([sys.executable, "-c", "raise SystemExit(3)"], port, tmp_path / "logs/b.log", "a test server"):
            pass
    with socket_on(port), pytest.raises(targets.TargetError, match=f"port {port} of 127.0.0.1 is in use"):
        with targets.served(argv, port, tmp_path / "logs/c.log", "a test server"):
            pass
    # a server that dies while in use (this one after its readiness answer): the error names its exit and its log,
    # not the refused connection
    once = ("import http.server, sys; s = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), "
            "http.server.SimpleHTTPRequestHandler); s.handle_request(); sys.exit(5)")
    with pytest.raises(targets.TargetError, match=r"a test server exited with 5 while in use \(see logs/d.log\)"):
        with targets.served([sys.executable, "-c", once, str(port)], port, tmp_path / "logs/d.log", "a test server",
                            ready="/", cwd=tmp_path):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)


@contextlib.contextmanager
def socket_on(port: int):
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the last server's TIME_WAIT
        s.bind(("127.0.0.1", port))
        s.listen()
        yield


def test_quality_runs_an_engines_entry_by_name(shared, tmp_path):
    """The quality stage takes an `engines:` entry by its name (here a serve target, started and stopped as the
    stage's own engine server is): on random weights the engine served twice must give identical completions."""
    from evident.workflow.core.evidence import write_text
    from evident.workflow.stages import checkpoint as record_stage
    from evident.workflow.stages import quality

    root, ckpt, _, _ = shared
    spec = {"name": "served", "kind": "openai", "serve": {"command": SERVE}}
    cfg = tinyev.config(engines=[spec], quality={
        "targets": ["engine", "served"], "reference": "engine", "advisory": True,
        "gsm8k": {"source": "embedded", "limit": 2, "shots": 1, "max_tokens": 8}})
    ev = tmp_path / "ev"
    write_text(ev / "config.yaml", yaml.safe_dump(cfg))
    record_stage.record(ckpt, ev)
    with engine_on_path(root, None):
        doc = quality.run(ckpt, ev, engines={"served": spec})
    g = doc["gates"][0]
    assert (g["candidate"], g["same_completion"], g["rows"]) == ("served", 2, 2), g  # no_claim: no valid answer
    assert (ev / "logs/quality-served-server.log").is_file() and (ev / "logs/quality-engine-server.log").is_file()
    assert "served" in read_json(ev / "quality/gsm8k-served.json")["implementation"]
