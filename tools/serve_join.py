"""engine.serve's two answers to a row that arrives while a batch decodes (``--join step``: it joins at the next step;
``--join batch``: it waits for the next batch), measured on a finished campaign's checkpoint and bench settings.

    python3 tools/serve_join.py evidence/<campaign>/<id> [--concurrency 8] [--gap-ms G] [--json OUT]

Starts the builtin engine's server once per policy (the campaign's device, dtype and decode path, bench.kernels) and
sends rounds of C streaming requests (the campaign's bench.prompts, one each, else bench.prompt), request r sent
r * gap ms after the first, so that later ones arrive while the first decode; each asks bench.new_tokens tokens.
bench.warmup rounds (at least 2), then bench.repeats measured ones. The gap defaults to one request's time alone over
C, measured on the first server: the arrivals spread over about one batch's decode. Prints, per policy, vLLM's client
metrics (workflow.benchstats.summarize_http: TTFT, TPOT, ITL, E2E) and each arrival's mean TTFT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from tokenizers import Tokenizer  # noqa: E402

from evident.engine.serve import JOINS  # noqa: E402
from evident.workflow.bench.benchstats import summarize_http  # noqa: E402
from evident.workflow.core import layout  # noqa: E402
from evident.workflow.core.evidence import read_config  # noqa: E402
from evident.workflow.plan import environment, targets  # noqa: E402
from evident.workflow.plan.estimate import checkpoint_dir  # noqa: E402
from evident.workflow.plan.runs import DISTINCT, SAME, prompt_texts  # noqa: E402
from evident.workflow.bench.load import USAGE, round_of  # noqa: E402


def policy(join: str, ckpt: Path, cfg: dict, texts: list[str], gap_s: float | None, log: Path) -> dict:
    """One server with --join join: its rounds and their summary (gap_s None: measured here first)."""
    bench, tok = cfg["bench"], Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    bodies = [{"prompt": t, "max_tokens": bench["new_tokens"], "ignore_eos": True, **USAGE} for t in texts]
    with targets.engine_server(ckpt, environment.resolve_device(cfg["device"]), cfg["dtype"], log,
                               kernels=bench["kernels"], args=("--join", join)) as (base, ready_s), \
            ThreadPoolExecutor(len(texts)) as pool:
        client = targets.Client(base).connect()
        if gap_s is None:  # one request alone, warm
            alone = [round_of(pool, client, bodies[:1], tok)["duration_ms"] for _ in range(2)][-1]
            gap_s = alone / 1e3 / len(texts)
        for _ in range(max(2, bench["warmup"])):  # every width the rounds step captured (the graph path) first
            round_of(pool, client, bodies, tok, gap_s)
        repeats = []
        for r in range(bench["repeats"]):
            repeats.append(round_of(pool, client, bodies, tok, gap_s))
            print(f"[join {join}] round {r + 1}/{bench['repeats']}: {repeats[-1]['duration_ms']:.1f} ms", flush=True)
    stats = summarize_http(repeats, len(texts), bench["new_tokens"])
    ttft = [statistics.mean(rep["requests"][i]["chunk_ms"][0] for rep in repeats) for i in range(len(texts))]
    return {"join": join, "gap_ms": gap_s * 1e3, "ready_s": ready_s, "stats": stats, "ttft_by_arrival_ms": ttft,
            "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evidence", type=Path, help="the campaign's evidence directory")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--gap-ms", type=float, default=None, help="between arrivals (default: measured, see above)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: the campaign's (its cache directory)")
    ap.add_argument("--json", type=Path, default=None, help="write every round and summary here")
    a = ap.parse_args()
    if not (a.evidence / layout.CONFIG).is_file():
        ap.error(f"{a.evidence} is not a campaign's evidence directory (no config.yaml): evidence/<campaign>/<id>")
    cfg = read_config(a.evidence / layout.CONFIG)
    ckpt = a.checkpoint or REPO / checkpoint_dir(cfg)
    contract = DISTINCT if len(cfg["bench"].get("prompts") or []) >= a.concurrency else SAME
    texts = prompt_texts(cfg["bench"], a.concurrency, contract)
    gap_s, out = None if a.gap_ms is None else a.gap_ms / 1e3, []
    for join in JOINS:
        out.append(policy(join, ckpt, cfg, texts, gap_s, Path(f"/tmp/serve_join-{join}.log")))
        gap_s = out[-1]["gap_ms"] / 1e3
        time.sleep(1)  # the port and the device freed
    print(f"\n{a.concurrency} requests ({contract}), one every {gap_s * 1e3:.2f} ms, "
          f"{cfg['bench']['new_tokens']} tokens each, {cfg['dtype']} on {cfg['device']} ({cfg['bench']['kernels']})")
    print("| join | TTFT p50 / p99 | TPOT p50 | ITL p50 / p99 | E2E p50 / p99 | output tok/s | TTFT by arrival |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in out:
        s = r["stats"]
        print(f"| {r['join']} | {s['ttft']['p50']:.1f} / {s['ttft']['p99']:.1f} ms | {s['tpot']['p50']:.3f} ms | "
              f"{s['itl']['p50']:.2f} / {s['itl']['p99']:.2f} ms | {s['e2e']['p50']:.1f} / {s['e2e']['p99']:.1f} ms | "
              f"{s['output_tok_s']:.1f} | {', '.join(f'{t:.0f}' for t in r['ttft_by_arrival_ms'])} ms |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
