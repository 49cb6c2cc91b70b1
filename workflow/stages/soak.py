"""Stage `soak`: each target's server kept busy for `soak.duration_s` at Poisson arrivals of `soak.rate` requests a
second (seeded by `soak.seed`), the targets one after another in one job (`soak.targets`, by default the HTTP bench's:
`engine`, the builtin engine's server, and `openai` entries of `engines:`). Every request is the HTTP bench's (a
stream of `bench.prompt` asking `bench.new_tokens` tokens; workflow/bench/load.py `sweep`). A target's record
(soak/<target>.json) holds:

- its requests, and its errors: every request that failed or cannot be measured (must be 0);
- the server's memory over time (the resident set of its process tree, sampled every SAMPLE_S) where the server was
  started here; a url target's is unknown (`known: false`), never 0. Growth is flagged by MEMORY_GROWTH;
- latency drift: TTFT, TPOT and E2E p50 of the requests sent in the first and in the last minute, and last over first
  (a soak shorter than WINDOWS_S has no two minutes apart: its first and last third, which the record says);
- the server's death: where its process exits before the soak ends, when (seconds into the soak), its exit code and
  its log's last lines, and no request is sent after; one that exits before it is ready, the error saying so.

The verdict (soak/gate.json, the soak gate of workflow/core/gates.py): `fail` where a target had an error, its server
died or its memory grew, each a reason; else `pass`. Drift is recorded, not gated: one soak's two windows hold no
estimate of the machine's noise (the bench's noise rule needs repeats). A server that dies is evidence: the record
says how and the stage ends as it does for any verdict, so the campaign seals and the gate fails it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from evident.workflow.bench.benchstats import summarize_rate
from evident.workflow.bench.load import extras, poisson_offsets, started_here, sweep, target_url
from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, read_config, read_json, stage_args
from evident.workflow.core.gates import BY_NAME
from evident.workflow.core.privacy import scrub
from evident.workflow.models import checkpoints
from evident.workflow.plan import environment, targets
from evident.workflow.plan.runs import SAME, prompt_keys

SOAK_GATE = BY_NAME["soak"]
SAMPLE_S = 1.0  # the memory and liveness sample's period; a short soak samples SAMPLES times at least
SAMPLES = 30
WINDOWS_S = 180  # a soak this long compares its first and last minute; a shorter one its first and last third
WINDOW_S = 60
# Growth: the resident set's median over the soak's last third above its median over the middle third, by more than
# MEMORY_GROWTH of it and more than MEMORY_GROWTH_MB. The first third is left out: a server's first requests fill its
# allocator's pools and caches, which then stay. Under a steady load a server that frees what each request took
# holds a flat resident set; the floor in MB keeps a small server's allocator noise from reading as a leak.
MEMORY_GROWTH = 0.05
MEMORY_GROWTH_MB = 32.0
MEMORY_RULE = (f"median RSS of the last third over the middle third's: flagged above +{MEMORY_GROWTH:.0%} and "
               f"+{MEMORY_GROWTH_MB:g} MB (the first third is the server's warm-up)")
LOG_TAIL = 20  # lines of a dead server's log kept in its record
PROC = Path("/proc")


# --- the server's process tree (Linux's /proc) -------------------------------------------------------------------

def children(pid: int) -> list[int]:
    """The processes whose parent is pid."""
    out = []
    for d in PROC.iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])  # the name may hold spaces
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if ppid == pid:
                out.append(int(d.name))
    return out


def tree(pid: int) -> list[int]:
    """pid and every process below it (a `timeout` or shell wrapper's server is its child)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


def rss_mb(pid: int) -> float:
    """The resident set of pid's process tree, MB (a process gone meanwhile counts 0)."""
    total = 0
    for p in tree(pid):
        try:
            total += int((PROC / str(p) / "statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total * os.sysconf("SC_PAGE_SIZE") / 1e6


def exit_code(pid: int) -> int | None:
    """A child process's exit code once it has exited (minus the signal that killed it), None while it runs. Peeked
    (WNOWAIT), not reaped: the Popen that started it (targets.served) still waits for it."""
    try:
        got = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if got is None:
        return None
    return got.si_status if got.si_code == os.CLD_EXITED else -got.si_status


def log_tail(log: Path) -> list[str]:
    """A server log's last LOG_TAIL lines, scrubbed as sealing scrubs logs."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [scrub(line) for line in lines[-LOG_TAIL:]]


# --- what a soak's requests and samples say ----------------------------------------------------------------------

def windows(duration_s: float) -> dict:
    """The two windows latency drift compares, in seconds from the soak's start, and which rule chose them."""
    if duration_s >= WINDOWS_S:
        return {"rule": f"first and last minute (the soak lasted {duration_s:g} s)",
                "first": [0.0, WINDOW_S], "last": [duration_s - WINDOW_S, duration_s]}
    third = duration_s / 3
    return {"rule": f"first and last third: the soak lasted {duration_s:g} s, under {WINDOWS_S} s has no two minutes "
                    "apart", "first": [0.0, third], "last": [duration_s - third, duration_s]}


def drift(requests: list[dict], duration_s: float, new_tokens: int) -> dict:
    """TTFT, TPOT and E2E p50 of the requests sent in each window, and last over first (None where a window holds no
    completed request)."""
    out = windows(duration_s)
    for name in ("first", "last"):
        lo, hi = out[name]
        mine = [r for r in requests if lo * 1e3 <= r["sent_ms"] < hi * 1e3]
        s = summarize_rate(mine, (hi - lo) * 1e3, new_tokens, None) if mine else None
        out[f"{name}_p50_ms"] = {m: s[m]["p50"] for m in ("ttft", "tpot", "e2e")} if s and s["tpot"] else None
        out[f"{name}_requests"] = len(mine)
    a, b = out["first_p50_ms"], out["last_p50_ms"]
    out["last_over_first"] = {m: b[m] / a[m] for m in a} if a and b else None
    return out


def growth(samples: list[list[float]], duration_s: float) -> dict:
    """The memory rule (MEMORY_GROWTH) on [seconds, MB] samples."""
    middle = [mb for t, mb in samples if duration_s / 3 <= t < 2 * duration_s / 3]
    last = [mb for t, mb in samples if t >= 2 * duration_s / 3]
    rule = {"rule": MEMORY_RULE}
    if not middle or not last:
        return {**rule, "growth_mb": None, "growth": None, "flagged": False,
                "why": "no sample in the middle or the last third (the server died first)"}
    a, b = float(np.median(middle)), float(np.median(last))
    return {**rule, "middle_mb": a, "last_mb": b, "growth_mb": b - a, "growth": (b - a) / a,
            "flagged": (b - a) / a > MEMORY_GROWTH and b - a > MEMORY_GROWTH_MB}


# --- one target --------------------------------------------------------------------------------------------------

def soak_target(spec: dict, ckpt: Path, evidence: Path, config: dict, tok: Tokenizer, log) -> dict:
    """One target's soak, as the module docstring says; never raises for what its server does."""
    soak, bench, name = config["soak"], config["bench"], spec["name"]
    device = environment.resolve_device(config["device"])
    dtype = spec.get("dtype") or config["dtype"]
    here = started_here(spec)
    server_log = evidence / layout.log(f"soak-{name}-server")
    duration, period = float(soak["duration_s"]), min(SAMPLE_S, soak["duration_s"] / SAMPLES)
    offsets = poisson_offsets(soak["rate"], soak["seed"], duration_s=duration)
    record = {"target": name, "kind": spec["kind"], "started": "here" if here else "url", "dtype": dtype,
              "device": device if here else None,
              "contract": {"duration_s": duration, "rate": soak["rate"], "arrivals": "poisson", "seed": soak["seed"],
                           **prompt_keys([bench["prompt"]], [tok.encode(bench["prompt"]).ids], SAME),
                           "new_tokens": bench["new_tokens"]}}
    samples: list[list[float]] = []
    death: dict = {}
    done, pid, failed = None, None, None
    before = set(children(os.getpid())) if PROC.is_dir() else set()
    try:
        with target_url(spec, ckpt, dtype, device, bench["kernels"], server_log) as base:
            if here and PROC.is_dir():
                new = sorted(set(children(os.getpid())) - before)
                pid = new[0] if len(new) == 1 else None
            client = targets.Client(base).connect()
            extra, eos = extras(client, [bench["prompt"]], bench["new_tokens"])
            record["contract"].update(request_extras=sorted(extra), ignore_eos=eos)
            stop, finished = threading.Event(), threading.Event()
            t0 = time.perf_counter()

            def watch() -> None:
                """Sample the server's memory, and see it die (then no request is sent after)."""
                while True:
                    at = time.perf_counter() - t0
                    if (code := exit_code(pid)) is not None:
                        death.update(at_s=round(at, 3), exit_code=code)
                        stop.set()
                        return
                    samples.append([round(at, 3), round(rss_mb(pid), 3)])
                    if finished.wait(period):
                        return

            watcher = threading.Thread(target=watch, daemon=True)
            if pid is not None:
                watcher.start()
            log(f"soaking for {duration:g} s at {soak['rate']:g} requests/s (extras {sorted(extra) or 'none'})")
            try:
                done = sweep(client, {"prompt": bench["prompt"], "max_tokens": bench["new_tokens"], **extra}, offsets,
                             tok, stop, progress=log)
            finally:
                finished.set()
                if pid is not None:
                    watcher.join()
    except (targets.TargetError, OSError, http.client.HTTPException, ValueError) as e:
        failed = str(e)[:500]  # it exited before it was ready, or failed the client's first requests: no soak ran
    reqs = done["requests"] if done else []
    stats = summarize_rate(reqs, done["duration_ms"], bench["new_tokens"], None) if reqs else None
    record["counts"] = {"planned": len(offsets), "sent": len(reqs), "unsent": done["unsent"] if done else len(offsets),
                        "errors": stats["failed"] if stats else 0, "error_samples": stats["failures"][:10] if stats else []}
    record["stats"] = stats
    record["latency"] = drift(reqs, duration, bench["new_tokens"]) if reqs else None
    if pid is not None:
        record["memory"] = {"known": True, "what": "resident set of the server's process tree (MB)",
                            # the thirds of the time sampled: a slow server's last requests end past duration
                            "samples": samples, **growth(samples, samples[-1][0] if samples else duration)}
    else:
        why = ("a url target: its server runs elsewhere" if not here else
               "the server's process was not found here (no /proc, or not one new child process)")
        record["memory"] = {"known": False, "why": f"unknown, not 0: {why}"}
    record["server"] = {"died": bool(death), **death, "failed": failed}
    if death or failed:
        record["server"]["log_tail"] = log_tail(server_log)
    record["requests"] = reqs
    counts, reasons = record["counts"], []
    if failed:
        reasons.append(f"{name}: no soak ran: {failed[:300]}")
    if counts["errors"]:
        first = counts["error_samples"][0]["error"]
        reasons.append(f"{name}: {counts['errors']} of {counts['sent']} requests failed (first: {first[:200]})")
    if death:
        reasons.append(f"{name}: the server died {death['at_s']:.1f} s into the soak, exit code {death['exit_code']}")
    if record["memory"].get("flagged"):
        m = record["memory"]
        reasons.append(f"{name}: memory grew {m['growth_mb']:+.1f} MB ({m['growth']:+.1%}) from the middle to the last "
                       "third of the soak")
    record["verdict"], record["reasons"] = ("fail" if reasons else "pass"), reasons
    return record


def headline(r: dict) -> str:
    """A target's soak in a phrase."""
    m, lat = r["memory"], r["latency"] or {}
    mem = (f"RSS {m['growth_mb']:+.1f} MB ({m['growth']:+.1%})" if m.get("growth") is not None else
           "RSS unknown" if not m["known"] else "RSS growth unknown")
    tpot = (lat.get("last_over_first") or {}).get("tpot")
    return (f"`{r['target']}` {r['counts']['sent']} requests, {r['counts']['errors']} errors, {mem}"
            + (f", TPOT p50 x{tpot:.2f} last/first" if tpot else "")
            + (f", died at {r['server']['at_s']:.1f} s (exit {r['server']['exit_code']})" if r["server"]["died"] else "")
            + (", did not start" if r["server"]["failed"] else ""))


def run(ckpt: Path, evidence: Path, specs: list[dict]) -> None:
    config = read_config(evidence / layout.CONFIG)
    soak = config["soak"]
    params = {"targets": [s["name"] for s in specs], "duration_s": soak["duration_s"], "rate": soak["rate"],
              "seed": soak["seed"]}
    with Stage(evidence, "soak", params=params) as st:
        checkpoints.verify(ckpt, read_json(evidence / layout.CHECKPOINT))
        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        records = []
        for spec in specs:
            def log(msg: str, name=spec["name"]) -> None:
                print(f"[soak {name}] {msg}", flush=True)

            r = soak_target(spec, ckpt, evidence, config, tok, log)
            st.write_json(layout.soak_record(spec["name"]), r)
            if (server_log := evidence / layout.log(f"soak-{spec['name']}-server")).is_file():
                st.add_file(server_log)
            records.append(r)
            log(f"{r['verdict']}: {headline(r)}" + "".join(f"; {why}" for why in r["reasons"]))
            st.metrics.update({f"{spec['name']}_errors": r["counts"]["errors"],
                               f"{spec['name']}_died": int(r["server"]["died"])})
            if r["memory"].get("growth") is not None:
                st.metrics[f"{spec['name']}_rss_growth"] = r["memory"]["growth"]
            if (ratio := (r["latency"] or {}).get("last_over_first")):
                st.metrics[f"{spec['name']}_tpot_p50_drift"] = ratio["tpot"]
        reasons = [why for r in records for why in r["reasons"]]
        verdict = "fail" if reasons else "pass"
        st.write_json(layout.SOAK_GATE, {
            "verdict": verdict, "verdict_reason": "; ".join(headline(r) for r in records),
            "reason": "; ".join(reasons) or None,
            "targets": {r["target"]: {"verdict": r["verdict"], "reasons": r["reasons"]} for r in records},
            "rules": {"errors": "every request must complete its new_tokens, streamed", "memory": MEMORY_RULE,
                      "drift": "recorded, not gated", "death": "the server's process must not exit during the soak"}})
        st.tags[SOAK_GATE.tag] = verdict


def main(argv: list[str] | None = None) -> None:
    ap: argparse.ArgumentParser = stage_args(__doc__, checkpoint=True)
    ap.add_argument("--specs", required=True, type=json.loads,
                    help=f'the targets, in order: [{{"name": "{targets.ENGINE}", "kind": "{targets.BUILTIN}"}}, or '
                         "`engines:` entries of kind openai], as JSON")
    args = ap.parse_args(argv)
    try:
        run(args.checkpoint, args.evidence, args.specs)
    except (checkpoints.CheckpointInvalid, OSError) as e:
        sys.exit(f"[soak] error: {e}")


if __name__ == "__main__":
    main()
