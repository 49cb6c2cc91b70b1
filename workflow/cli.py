"""`evident`: browse, compare, verify and sync the evidence archive.

  evident ls [--campaign C]      every evidence directory, newest first, with each gate's verdict
  evident show ID                one directory's summary
  evident diff A B               B against A: bench cells with noise-aware claims, metrics, verdict changes
  evident verify [ID ...|--all]  re-hash every file against MANIFEST.json
  evident sync [ID ...|--all]    replay evidence into MLflow (idempotent)
  evident html                   rewrite the static HTML archive (evidence/index.html)
  evident run [SNAKEMAKE ARGS]   check the --configfile campaign files, then run snakemake with these arguments

An ID is an evidence id, `campaign/id`, a path, or a prefix of an id that matches one directory.
Exit status: 0 fine, 1 a mismatch or a failed sync, 2 an error (an id that matches nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tabulate import tabulate

from workflow import archive

MISMATCH, ERROR = 1, 2


def _records(args) -> Path:
    """Sync records live in the archive's working directory, beside `evidence/`."""
    return Path(args.root).parent / archive.TRACKING_RECORDS


def _load(args, ref: str) -> archive.Evidence:
    return archive.load(archive.resolve(ref, args.root), _records(args))


def _num(v, fmt: str = ".4g") -> str:
    return "—" if v is None else (format(v, fmt) if isinstance(v, float) else str(v))


def _pct(v) -> str:
    return "—" if v is None else f"{v:+.1f}%"


def _table(header, rows) -> str:
    return tabulate(rows, headers=header, tablefmt="simple", disable_numparse=True)


# --- ls, show --------------------------------------------------------------------------------

def cmd_ls(args) -> int:
    if args.campaign and not (Path(args.root) / args.campaign).is_dir():
        print(f"evident: no campaign {args.campaign!r} under {Path(args.root).as_posix()}/", file=sys.stderr)
        return ERROR
    entries = archive.listing(args.root, args.campaign, _records(args))
    if not entries:
        print(f"no evidence directories under {Path(args.root).as_posix()}/")
        return 0
    gates = list(dict.fromkeys(g for e in entries for g in e.gates))
    rows = [[e.path.parent.name, e.id, (e.created or "—").replace("T", " "), e.commit, e.device,
             *(e.gates.get(g, "—") for g in gates), e.tracking.get("status", "?"), e.state] for e in entries]
    print(_table(["campaign", "id", "created (UTC)", "commit", "device", *gates, "mlflow", "state"], rows))
    return 0


def cmd_show(args) -> int:
    ev = _load(args, args.id)
    m, track = ev.manifest or {}, ev.tracking
    facts = [
        ["evidence", f"{ev.label}  ({ev.path.as_posix()})"],
        ["state", ev.state],
        ["created / sealed (UTC)", f"{ev.created or '—'} / {m.get('sealed_utc', '—')}"],
        ["commit", ev.commit],
        ["device / dtype", f"{ev.device} / {ev.config.get('dtype', '?')}"],
        ["verdicts", ", ".join(f"{k}: {v}" for k, v in ev.gates.items()) or "—"],
        ["mlflow", track.get("status", "?") + (f": experiment {track['experiment_id']}, parent run "
                                               f"{track['parent_run_id']}" if track.get("parent_run_id") else "")],
    ]
    print(tabulate(facts, tablefmt="plain"))
    print()
    print(_table(["stage", "status", "seconds", "note"],
                 [[r.get("name"), r.get("status"), _num(r.get("seconds")), r.get("error") or r.get("reason") or ""]
                  for r in ev.records]))
    summary = ev.path / "SUMMARY.md"
    if summary.is_file():
        print()
        print(summary.read_text(errors="replace").rstrip())
    else:
        print("\n(no SUMMARY.md: the directory is not sealed)")
    return 0


# --- diff ------------------------------------------------------------------------------------

def cmd_diff(args) -> int:
    a, b = _load(args, args.a), _load(args, args.b)
    d = archive.diff(a, b)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"A (baseline): {d['a']}\nB (current):  {d['b']}\n")
    print("What limits the comparison:")
    print("\n".join(f"  - {x}" for x in d["limits"]) or "  nothing: same campaign, config, versions and checkpoint")
    print("\nVerdict changes:")
    print(_table(["what", "A", "B"], [[v["what"], v["a"] or "—", v["b"] or "—"] for v in d["verdicts"]])
          if d["verdicts"] else "  none")
    if d["bench"]:
        print("\nDecode benchmark (B against A; a claim needs the same contract, versions and model, no noisy cell, "
              "and a TPOT p50 change beyond the noise):")
        print(_table(["backend", "batch", "TPOT p50 A (ms)", "B", "change", "tok/s A", "B", "change", "claim", "reason"],
                     [[c["backend"], c["batch"], _num(c["a_tpot_p50_ms"]), _num(c["b_tpot_p50_ms"]),
                       _pct(c["tpot_p50_change_pct"]), _num(c["a_tok_s"]), _num(c["b_tok_s"]),
                       _pct(c["tok_s_change_pct"]), c["claim"], c["reason"] or ""] for c in d["bench"]]))
    changed = [x for x in d["metrics"] if x["a"] != x["b"]]
    if d["metrics"]:
        print(f"\nStage metrics ({len(d['metrics']) - len(changed)} equal, not shown; single values carry no noise "
              "estimate, so they make no directional claim):")
        print(_table(["metric", "A", "B", "delta", "change"],
                     [[x["metric"], _num(x["a"]), _num(x["b"]), _num(x["delta"]), _pct(x["delta_pct"])]
                      for x in changed]) if changed else "  none changed")
    return 0


# --- verify, sync ----------------------------------------------------------------------------

def _targets(args) -> list[Path]:
    if args.all == bool(args.ids):
        raise archive.NotFound("name evidence directories or give --all (not both)")
    if args.all:
        return [d for d in archive.evidence_dirs(args.root)]
    return [archive.resolve(ref, args.root) for ref in args.ids]


def cmd_verify(args) -> int:
    bad = 0
    for path in _targets(args):
        name = archive.label(path)
        if not (path / "MANIFEST.json").is_file():
            if args.all:
                print(f"skip  {name}: not sealed")
                continue
            print(f"FAIL  {name}: not sealed (no MANIFEST.json)")
            bad += 1
            continue
        result = archive.verify(path)
        if archive.intact(result):
            print(f"ok    {name}")
            continue
        bad += 1
        parts = [f"{k} {', '.join(v)}" for k, v in result.items() if v and k != "problems"] + result["problems"]
        print(f"FAIL  {name}: " + "; ".join(parts))
    return MISMATCH if bad else 0


def cmd_sync(args) -> int:
    failed = 0
    for path in _targets(args):
        ev = archive.load(path, _records(args))
        name = ev.label
        if not ev.sealed:
            print(f"{'skip' if args.all else 'FAIL'}  {name}: not sealed")
            failed += not args.all
            continue
        if args.all and ev.tracking.get("status") == "disabled":
            print(f"skip  {name}: tracking disabled for its campaign (name it to sync it anyway)")
            continue
        try:
            ids = archive.sync(path, args.tracking_uri, _records(args))
        except Exception as e:  # an unreachable store: the evidence stays pending, nothing is lost
            print(f"FAIL  {name}: tracking unreachable: {type(e).__name__}: {e}")
            failed += 1
            continue
        print(f"ok    {name}: experiment {ids['experiment_id']}, parent run {ids['parent_run_id']}, "
              f"{len(ids['child_run_ids'])} stage runs")
    return MISMATCH if failed else 0


def cmd_html(args) -> int:
    from workflow.stages import html

    written = html.write_archive(args.root, args.tracking_uri, _records(args))
    print(f"{Path(args.root).as_posix()}/index.html: {len(written) - 1} evidence pages")
    return 0


def configfiles(argv: list[str]) -> list[str]:
    """The paths after `--configfile(s)` (several may follow one flag) or in `--configfile=PATH`."""
    paths, taking = [], False
    for a in argv:
        flag, eq, value = a.partition("=")
        if flag in ("--configfile", "--configfiles"):
            taking = not eq
            paths += [value] if eq else []
        elif taking and not a.startswith("-"):
            paths.append(a)
        else:
            taking = False
    return paths


def cmd_run(argv: list[str]) -> int:
    """Snakemake answers a campaign file it cannot decode with a traceback: check each first, then hand over."""
    from workflow.campaign import CampaignFileError, read_campaign_file

    try:
        for path in configfiles(argv):
            read_campaign_file(path)
    except CampaignFileError as e:
        print(f"evident: {e}", file=sys.stderr)
        return ERROR
    snakemake = Path(sys.executable).with_name("snakemake")  # the one installed beside this interpreter
    os.execv(snakemake, [str(snakemake), *argv])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="evident", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=archive.ROOT, help="the evidence archive (default: evidence/)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("ls", help="list evidence directories, newest first")
    p.add_argument("--campaign")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("show", help="one directory's summary")
    p.add_argument("id")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("diff", help="compare B against A (A is the baseline)")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", action="store_true", help="the comparison as JSON")
    p.set_defaults(func=cmd_diff)
    for name, func, what in (("verify", cmd_verify, "re-hash every file against MANIFEST.json"),
                             ("sync", cmd_sync, "replay evidence into MLflow (idempotent)")):
        p = sub.add_parser(name, help=what)
        p.add_argument("ids", nargs="*", metavar="ID")
        p.add_argument("--all", action="store_true", help="every directory in the archive")
        if name == "sync":
            p.add_argument("--tracking-uri", default=None, help="else MLFLOW_TRACKING_URI, else MLflow's default store")
        p.set_defaults(func=func)
    p = sub.add_parser("html", help="rewrite the static HTML archive")
    p.add_argument("--tracking-uri", default=None, help="an http(s) MLflow server to link runs to")
    p.set_defaults(func=cmd_html)
    sub.add_parser("run", help="check the --configfile campaign files, then run snakemake with the same arguments",
                   add_help=False)  # main() hands its arguments to snakemake before argparse sees them
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # its arguments are snakemake's, not ours to parse
        return cmd_run(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except archive.NotFound as e:
        print(f"evident: {e}", file=sys.stderr)
        return ERROR
    except BrokenPipeError:  # `evident show X | head`: the reader has all it wanted
        sys.stdout = None
        return 0


if __name__ == "__main__":
    sys.exit(main())
