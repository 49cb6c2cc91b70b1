"""`evident`: browse, compare, verify, sync and prune the evidence archive.

  evident ls [--campaign C]     every evidence directory, newest first: gates, MLflow, status
                                (sealed, running, failed or interrupted)
  evident show ID [--markdown]  one directory: gates, headline figures, stages, files
                                (--markdown: its SUMMARY.md)
  evident diff A B [--metrics]  B against A: verdict changes, bench cells with noise-aware claims
                                (--metrics: every stage metric that differs too)
  evident verify [ID ...|--all] re-hash every file against MANIFEST.json
  evident sync [ID ...|--all]   replay evidence into MLflow (idempotent)
  evident prune [--unsealed] [--older-than D [--sealed]] [--campaign C] [--dry-run]
                                remove failed or old directories, and mark their MLflow runs deleted
  evident html                  rewrite the static HTML archive (evidence/index.html)
  evident trend [--campaign C] [--cell CELL] [--metric M]
                                each bench cell and gate over a campaign's directories, regressions
                                flagged
  evident ui [--port P]         MLflow's UI on this directory's store, on 127.0.0.1
                                (installed on first use)
  evident run [SNAKEMAKE ARGS]  check the --configfile campaign files, then run snakemake with these
                                arguments and --rerun-incomplete: an interrupted run goes on

An ID is an evidence id, `campaign/id`, a path, or any part of an id that matches one directory
(`c526`, its config hash, or the commit); an exact id wins over longer ones that contain it.
`CAMPAIGN@latest` is the campaign's newest *sealed* directory (by its manifest's creation time),
`CAMPAIGN@latest~N` the N-th before it, `@latest` the newest over all campaigns:
`evident diff tiny@latest~1 tiny@latest`.
Exit status: 0 fine, 1 a mismatch or a failed sync or removal, 2 an error (an id that matches
nothing or several: the candidates are listed)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from evident.workflow import tracking
from evident.workflow.archive import archive, diff, pages, prune, trend, ui
from evident.workflow.core import layout
from evident.workflow.core.gates import GATES, NOT_RUN
from evident.workflow.core.layout import DETAILS, SUMMARY
from evident.workflow.core.terminal import age, fit, num, pct, ratio, size, wrap
from evident.workflow.plan.runs import label_key

MISMATCH, ERROR = 1, 2
ID_HELP = ("an evidence id, any part of one that matches one directory, CAMPAIGN/ID, a path, or CAMPAIGN@latest[~N] "
           "(the newest sealed directory, or the N-th before it; @latest: over all campaigns)")


def _records(args) -> Path:
    """Sync records live in the archive's working directory, beside `evidence/`."""
    return Path(args.root).parent / archive.TRACKING_RECORDS


def _load(args, ref: str) -> archive.Evidence:
    return archive.load(archive.resolve(ref, args.root), _records(args))


# --- ls, show --------------------------------------------------------------------------------

def _gates(ev: archive.Evidence) -> str:
    """`pass`, `FAIL` and the failing gates, or `—` where no gate decided (Gate.state: a verdict that measured
    nothing is neither); each gate's verdict is `evident show`'s."""
    states = {g.name: g.state(ev.gates.get(g.name)) for g in GATES}
    failing = [name for name, state in states.items() if state == "fail"]
    return "FAIL " + ", ".join(failing) if failing else "pass" if "pass" in states.values() else "—"


def _device(ev: archive.Evidence) -> str:
    """`cpu`, or how many GPUs (`8 GPUs`; their name is `show`'s)."""
    gpus = len(ev.env.get("gpus") or [])
    return f"{gpus} GPU{'s' * (gpus > 1)}" if gpus else ev.device


def _minute(utc: str) -> str:
    return utc[:16].replace("T", " ") if utc else "—"


def cmd_ls(args) -> int:
    if args.campaign and not (Path(args.root) / args.campaign).is_dir():
        print(f"evident: no campaign {args.campaign!r} under {Path(args.root).as_posix()}/", file=sys.stderr)
        return ERROR
    entries = archive.listing(args.root, args.campaign, _records(args))
    if not entries:
        print(f"no evidence directories under {Path(args.root).as_posix()}/")
        return 0
    # The same columns in the same order whatever is listed, each as short as it can be: the commit is the id's
    # first part; `show` names the GPUs and each gate's verdict. The id, to be copied, is cut last.
    rows = [[e.path.parent.name, e.id, _minute(e.created), _device(e), _gates(e),
             e.tracking.get("status", "?") if e.sealed else "—", e.status] for e in entries]
    print(fit(["campaign", "id", "created (UTC)", "device", "gates", "mlflow", "status"], rows, keep=(1, 2),
              tight=True))
    return 0


def _fact(name: str, value: str) -> str:
    return wrap(value, f"  {name:<16}", " " * 18)


def _bench(ev: archive.Evidence) -> list[list]:
    """A row per bench cell: its label, TPOT p50 (ms), tok/s and whether it is noisy (its figures then carry no
    claim; benchstats.noise)."""
    rows = []
    for name, files in sorted(diff.bench_cells(ev).items(), key=lambda kv: label_key(kv[0])):
        stats = archive.as_dict(files[0][1].get("stats"))
        tpot = diff.number(archive.as_dict(stats.get("tpot")).get("p50"))
        noisy = stats.get("noisy")
        rows.append([name, num(tpot), num(diff.tok_s(files[0][1]), ".1f"),
                     "yes" if noisy is True else "no" if noisy is False else "—"])
    return rows


def cmd_show(args) -> int:
    ev = _load(args, args.id)
    summary = ev.path / SUMMARY
    if args.markdown:
        if not summary.is_file():
            raise archive.NotFound(f"{ev.label} has no SUMMARY.md: it is {ev.status}, not sealed")
        print(summary.read_text(errors="replace").rstrip())
        return 0
    m, track = ev.manifest or {}, ev.tracking
    print(wrap(f"{ev.label}: {ev.state}"))
    sealed = f", sealed {m['sealed_utc']}" if m.get("sealed_utc") else ""
    print(_fact("created (UTC)", f"{ev.created or '—'}{sealed}"))
    print(_fact("commit", ev.commit))
    print(_fact("device / dtype", f"{ev.device} / {ev.config.get('dtype', '?')}"))
    runs = f": experiment {track['experiment_id']}, parent run {track['parent_run_id']}" \
        if track.get("parent_run_id") else ""
    print(_fact("mlflow", track.get("status", "?") + runs))
    print("\nGates:")
    print(fit(["gate", "verdict", "result"],
              [[g.name, ev.gates.get(g.name) or "—", g.state(ev.gates.get(g.name)).replace(NOT_RUN, "—")]
               for g in GATES]))
    # MLflow's headline but the bench cells, which have a table below: without their stages' records it reads no
    # cell file, and so no damaged one
    records = [r for r in ev.records if not r["name"].startswith(tracking.BENCH_STAGES)]
    figures, _ = tracking.headline(ev.path, records, {})
    if figures:
        print("\nHeadline figures (as MLflow names them):")
        print(fit(["figure", "value"], [[k, num(v)] for k, v in figures.items()]))
    if bench := _bench(ev):
        print("\nDecode benchmark (steady TPOT p50; a noisy cell's figures make no claim):")
        print(fit(["cell", "TPOT p50 (ms)", "tok/s", "noisy"], bench))
    print("\nStages:")
    print(fit(["stage", "status", "seconds", "note"],
              [[r.get("name"), r.get("status"), num(r.get("seconds")), r.get("error") or r.get("reason") or ""]
               for r in ev.records]) if ev.records else "  none recorded")
    print("\nFiles:")
    files = m.get("files") or {}
    total = sum(diff.number(archive.as_dict(f).get("size")) or 0 for f in files.values())
    print(_fact("directory", f"{ev.path.as_posix()}/" + (f" ({len(files)} files, {size(total)})" if files else "")))
    if summary.is_file():
        print(_fact("report", f"{SUMMARY} there, the pull-request section (`evident show --markdown ID` prints it); "
                              f"{DETAILS} beside it, the full tables"))
    if (page := pages.page_of(Path(args.root), ev)).is_file():
        print(_fact("page", page.as_posix()))
    return 0


# --- diff ------------------------------------------------------------------------------------

def _noisy(ev: archive.Evidence) -> set[str]:
    """The labels of a directory's noisy bench cells (their `stats.noisy`)."""
    return {name for name, files in diff.bench_cells(ev).items()
            if any(archive.as_dict(cell.get("stats")).get("noisy") is True for _, cell in files)}


def _bench_rows(cells: list[dict], noisy_a: set[str] = frozenset(), noisy_b: set[str] = frozenset()
                ) -> tuple[list[list], list[str]]:
    """One row per cell, which side's cell is noisy, its reason a numbered footnote (the same reason, the same
    number)."""
    notes: dict[str, int] = {}
    rows = []
    for c in cells:
        claim = c["claim"]
        if c["reason"]:
            claim += f" [{notes.setdefault(c['reason'], len(notes) + 1)}]"
        noisy = ", ".join(side for side, names in (("A", noisy_a), ("B", noisy_b)) if c["cell"] in names)
        rows.append([c["cell"], num(c["a_tpot_p50_ms"]), num(c["b_tpot_p50_ms"]), ratio(c["tpot_p50_ratio"]), noisy,
                     claim])
    return rows, [wrap(reason, f"  [{n}] ", " " * (len(str(n)) + 5)) for reason, n in notes.items()]


def cmd_diff(args) -> int:
    a, b = _load(args, args.a), _load(args, args.b)
    d = diff.diff(a, b)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"A (baseline): {d['a']}\nB (current):  {d['b']}\n")
    print("What limits the comparison:")
    print("\n".join(wrap(x, "  - ", "    ") for x in d["limits"])
          or "  nothing: same campaign, config, versions and checkpoint")
    print("\nVerdict changes:")
    print(fit(["what", "A", "B"], [[v["what"], v["a"] or "—", v["b"] or "—"] for v in d["verdicts"]])
          if d["verdicts"] else "  none")
    if d["bench"]:
        print("\n" + wrap("Decode benchmark, B against A (steady TPOT p50 in ms; B/A below 1: B is faster). A claim "
                          "needs the same contract, versions and model, no noisy cell, the machine probes alike, and a "
                          "TPOT p50 change beyond the noise and the minimum effect; noisy: the side whose cell is; "
                          "[n]: why a cell has none. tok/s and every field: --json."))
        rows, notes = _bench_rows(d["bench"], _noisy(a), _noisy(b))
        print(fit(["cell", "A TPOT p50 (ms)", "B", "B/A", "noisy", "claim"], rows))
        if notes:
            print("\n".join(notes))
    changed = [x for x in d["metrics"] if x["a"] != x["b"]]
    if not args.metrics:
        print("\n" + wrap(f"Stage metrics: {len(changed)} of {len(d['metrics'])} differ; single values with no noise "
                          "estimate, so no claim: --metrics lists them."))
    elif d["metrics"]:
        print("\n" + wrap(f"Stage metrics ({len(d['metrics']) - len(changed)} equal, not shown; single values carry "
                          "no noise estimate, so they make no directional claim):"))
        print(fit(["metric", "A", "B", "delta", "change"],
                  [[x["metric"], num(x["a"]), num(x["b"]), num(x["delta"]), pct(x["delta_pct"])]
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
        if not (path / layout.MANIFEST).is_file():
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


# --- prune -----------------------------------------------------------------------------------

def _age_arg(text: str) -> float:
    try:
        return prune.parse_age(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _forget(ev: archive.Evidence, uri: str | None, down: list[str]) -> str:
    """Mark the removed directory's MLflow runs deleted; never fails the prune. `down` remembers an
    unreachable store so that it is asked once, not once per directory."""
    recorded = prune.recorded_runs(ev)
    left = f"runs left ({len(recorded)} recorded, parent {recorded[0]})" if recorded else "any runs left"
    if down:
        return f"mlflow unreachable (above): {left}"
    try:
        result = prune.forget_runs(ev, uri)
    except Exception as e:  # an unreachable or missing store: the directory is gone all the same
        down.append(f"{type(e).__name__}: {e}")
        return f"mlflow unreachable ({down[0]}): {left}"
    if result is None:
        return "mlflow: tracking was disabled"
    if not result["deleted"] and not result["missing"]:
        return "mlflow: no runs"
    note = f"mlflow: {len(result['deleted'])} run{'' if len(result['deleted']) == 1 else 's'} marked deleted"
    if result["missing"]:
        note += f" ({len(result['missing'])} recorded run(s) not in this store: left)"
    return note


def cmd_prune(args) -> int:
    if args.sealed and (args.unsealed or args.older_than is None):
        raise archive.NotFound("--sealed goes with --older-than D (and not --unsealed): sealed directories "
                               "are removed only by age")
    if not args.unsealed and args.older_than is None:
        raise archive.NotFound("say what to prune: --unsealed, --older-than D, or both")
    root = Path(args.root)
    if args.campaign and not (root / args.campaign).is_dir():
        raise archive.NotFound(f"no campaign {args.campaign!r} under {root.as_posix()}/")
    plan = prune.prune_plan(root, unsealed=args.unsealed, older_than=args.older_than, sealed=args.sealed,
                              campaign=args.campaign, records=_records(args))
    if not plan:
        print(f"nothing to prune under {root.as_posix()}/" + (f"{args.campaign}/" if args.campaign else ""))
        return 0
    removed, kept, skipped, failed, freed, down = 0, 0, 0, 0, 0, []
    for p in plan:
        name, what = archive.label(p.path), f"{p.reason}, {age(p.age_s)}, {size(p.size)}"
        if p.action == "keep":
            kept += 1
            print(f"{'kept':<12}  {name}: {p.reason} ({age(p.age_s)})")
            continue
        if p.action == "skip":
            skipped += 1
            print(f"{'skipped':<12}  {name}: {p.reason}")
            continue
        if args.dry_run:
            removed, freed = removed + 1, freed + p.size
            print(f"{'would remove':<12}  {name}: {what}")
            continue
        try:
            prune.remove(p.path, root, _records(args))
        except prune.Held as h:
            skipped += 1
            print(f"{'skipped':<12}  {name}: being written by a running snakemake ({h})")
            continue
        except OSError as e:
            failed += 1
            print(f"{'FAIL':<12}  {name}: {type(e).__name__}: {e}")
            continue
        removed, freed = removed + 1, freed + p.size
        print(f"{'removed':<12}  {name}: {what}; {_forget(p.evidence, args.tracking_uri, down)}")
    dirs = f"{removed} director{'y' if removed == 1 else 'ies'} ({size(freed)})"
    total = [f"would remove {dirs}; nothing removed (--dry-run)" if args.dry_run else f"removed {dirs}"]
    total += [f"kept {kept} sealed"] if kept else []
    total += [f"skipped {skipped} held by a running snakemake"] if skipped else []
    total += [f"{failed} failed"] if failed else []
    print("total: " + "; ".join(total))
    if removed and not args.dry_run and (root / "index.html").is_file():
        written = pages.write_archive(root, args.tracking_uri, _records(args))
        print(f"{root.as_posix()}/index.html: rewritten, {len(written) - 1} evidence pages")
    return MISMATCH if failed else 0


def cmd_html(args) -> int:
    written = pages.write_archive(args.root, args.tracking_uri, _records(args))
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


INCOMPLETE_FLAGS = ("--rerun-incomplete", "--ri", "--ignore-incomplete", "--ii")
"""Snakemake's own say on a killed job's outputs: given any, `evident run` adds none."""


def snakemake_argv(argv: list[str]) -> list[str]:
    """The arguments `evident run` gives snakemake: the user's, with `--rerun-incomplete` first unless they chose.

    After a Ctrl-C or a kill, Snakemake flags the outputs of the jobs that were running as incomplete and refuses a
    plain rerun (IncompleteFilesException, advising --cleanup-metadata, which would keep those outputs as if whole).
    Rerunning those jobs is safe here: every stage writes each file atomically (evidence.write_*: a temp file, then
    a rename), so a stopped job leaves whole files or none, and the rerun rewrites them all; and the jobs flagged are
    a dead run's, since a second run of one evidence directory is refused before Snakemake looks
    (workflow/rules/common.smk, workflow/core/locks.py)."""
    if any(a.partition("=")[0] in INCOMPLETE_FLAGS for a in argv):
        return list(argv)
    return ["--rerun-incomplete", *argv]  # first: no option before it can take it as its value


def cmd_run(argv: list[str]) -> int:
    """Snakemake answers a campaign file it cannot decode with a traceback: check each first, then hand over."""
    from evident.workflow.plan.campaign import CampaignFileError, read_campaign_file

    try:
        for path in configfiles(argv):
            read_campaign_file(path)
    except CampaignFileError as e:
        print(f"evident: {e}", file=sys.stderr)
        return ERROR
    snakemake = Path(sys.executable).with_name("snakemake")  # the one installed beside this interpreter
    # what Snakemake and the rules' `tee` create (output folders, logs) readable by all, as the stages' own files
    os.umask(os.umask(0o022) & 0o022)
    os.execv(snakemake, [str(snakemake), *snakemake_argv(argv)])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="evident", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=archive.ROOT, help="the evidence archive (default: evidence/)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("ls", help="list evidence directories, newest first")
    p.add_argument("--campaign")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("show", help="one directory's summary")
    p.add_argument("id", metavar="ID", help=ID_HELP)
    p.add_argument("--markdown", action="store_true", help="print its SUMMARY.md, the pull-request section")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("diff", help="compare B against A (A is the baseline)")
    p.add_argument("a", metavar="A", help=ID_HELP)
    p.add_argument("b", metavar="B", help=ID_HELP)
    p.add_argument("--json", action="store_true", help="the comparison as JSON")
    p.add_argument("--metrics", action="store_true", help="also every stage metric that differs")
    p.set_defaults(func=cmd_diff)
    for name, func, what in (("verify", cmd_verify, "re-hash every file against MANIFEST.json"),
                             ("sync", cmd_sync, "replay evidence into MLflow (idempotent)")):
        p = sub.add_parser(name, help=what)
        p.add_argument("ids", nargs="*", metavar="ID", help=ID_HELP)
        p.add_argument("--all", action="store_true", help="every directory in the archive")
        if name == "sync":
            p.add_argument("--tracking-uri", default=None, help="else MLFLOW_TRACKING_URI, else MLflow's default store")
        p.set_defaults(func=func)
    p = sub.add_parser("prune", help="remove unsealed (failed, interrupted) or old evidence directories",
                       description="Remove evidence directories: unsealed ones (no MANIFEST.json: failed or "
                       "interrupted runs) and/or those older than D (by the manifest's created_utc; an unsealed "
                       "one by its mtime). A sealed directory is removed only with --sealed (and --older-than); "
                       "one a running snakemake holds (.evident/locks/<campaign>/<id>.lock) is skipped. The "
                       "MLflow runs of a removed directory are marked deleted; an unreachable store leaves them "
                       "and says so. evidence/index.html is rewritten when it exists.")
    p.add_argument("--unsealed", action="store_true", help="directories without a MANIFEST.json")
    p.add_argument("--older-than", type=_age_arg, metavar="D", help="older than D: 7d, 12h, 30m")
    p.add_argument("--sealed", action="store_true", help="remove sealed directories older than D too (else kept)")
    p.add_argument("--campaign", help="only this campaign's directories")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("--tracking-uri", default=None,
                   help="else MLFLOW_TRACKING_URI, else MLflow's default store (as sync; a campaign's tracking.uri "
                   "is not recorded in evidence: give it here)")
    p.set_defaults(func=cmd_prune)
    p = sub.add_parser("html", help="rewrite the static HTML archive")
    p.add_argument("--tracking-uri", default=None, help="an http(s) MLflow server to link runs to")
    p.set_defaults(func=cmd_html)
    trend.add_parser(sub)
    ui.add_parser(sub)
    sub.add_parser("run", help="check the --configfile campaign files, then run snakemake with the same arguments "
                   "(and --rerun-incomplete, unless one of " + ", ".join(INCOMPLETE_FLAGS) + " is given)",
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
