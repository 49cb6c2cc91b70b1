"""The pipeline's locks in `.evident/locks/` (flocks: the kernel drops one when its process ends, however it ends).

- `<campaign>/<id>.lock`: held exclusively by the one snakemake run writing that evidence directory, which writes there
  who it is (`describe`); `prune` takes it too, to remove the directory.
- `workdir.lock`: shared by every live run of the working directory; whoever gets it exclusively is alone, so the
  Snakemake locks in `.snakemake/locks/` and the lock files left are a killed run's, and go (`share_workdir`). While
  another run is live, Snakemake's refusal to lock the directory names that run instead of advising `--unlock`
  (`name_live_runs`).

A lock's file exists only while it is held: its last holder removes it before letting go, so that a refused or finished
run leaves none behind (a SIGKILLed run's stays, unheld, until the next holder takes and removes it). Taking one
therefore checks that the file it locked is still the one its path names.

The flock primitives of every other lock are here too: `flocked` (hold one for a block, waiting: the tracking store's
writers), `try_flock` (take one without waiting: a GPU of the local pool) and `held`/`holder` (is it held, by whom:
archive.running, `live_runs`)."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import time
from pathlib import Path

LOCKS = Path(".evident/locks")
WORKDIR = LOCKS / "workdir.lock"
SNAKEMAKE_LOCKS = Path(".snakemake/locks")


class Held(Exception):
    """A lock is held by a live process; the message is what its holder wrote there (`pid N ...`)."""


# --- the flock primitives (the module's docstring names their users) --------------------------------------------------

@contextlib.contextmanager
def flocked(path: str | Path, shared: bool = False):
    """Hold `path`'s flock (exclusive, or `shared`) for the block, waiting for it; its file is made if missing (not
    its folder) and left in place."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def try_flock(path: str | Path, shared: bool = False):
    """`path` opened ("a+", made if missing) and flocked without waiting, the file returned (its lock lasts until it
    is closed), or None while another holds it."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def _taken(f) -> bool:
    """Whether the open file `f`'s flock is held exclusively elsewhere: probed shared, without waiting."""
    try:
        fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def held(path: str | Path) -> bool:
    """Whether a live process holds `path`'s flock exclusively (a missing or unreadable file: nobody). The probe is
    shared and held for an instant, so two probes never refuse each other (nor see a shared holder); it makes no
    file."""
    try:
        with open(path) as f:
            return _taken(f)
    except OSError:
        return False


def holder(path: str | Path) -> str | None:
    """What the live exclusive holder of `path`'s flock wrote there ("" for nothing), or None where none holds it (as
    `held` probes)."""
    try:
        with open(path) as f:
            return f.read().strip() if _taken(f) else None
    except OSError:
        return None


def take(path: Path, how: int = fcntl.LOCK_EX | fcntl.LOCK_NB):
    """`path` opened and flocked (`how`); raises Held, naming the holder, when a non-blocking lock is taken."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            f = open(path, "a+")
        except FileNotFoundError:  # its folder removed by a holder letting go, between the two
            continue
        try:
            fcntl.flock(f, how)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "pid unknown"
            f.close()
            raise Held(holder) from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                return f
        f.close()  # its holder removed it as it let go, before we locked it: take the one the path names now


def let_go(f, path: Path) -> None:
    """Remove the lock's file and the folders it leaves empty, up to `.evident/locks/`, then release it."""
    folders = list(path.parents)
    top = next((i for i, d in enumerate(folders) if d.name == LOCKS.name), -1)
    with contextlib.suppress(OSError):
        path.unlink()
        for d in folders[:top + 1]:
            d.rmdir()  # only an empty one: stops at the first that is not
    f.close()


@contextlib.contextmanager
def holding(lock: Path, create: bool = True):
    """Hold `lock` (an evidence directory's): a snakemake that starts meanwhile is refused. Raises Held, naming the
    holder, when it is taken. `create` False: a missing lock file means that nobody holds it."""
    if not create and not lock.is_file():
        yield
        return
    f = take(lock)
    try:
        yield
    finally:
        let_go(f, lock)


def describe(campaign: str, eid: str, configfiles: list[str]) -> str:
    """What a run writes in its evidence directory's lock: what another run's refusal names."""
    return (f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: campaign {campaign}, evidence {eid}, "
            f"config {', '.join(configfiles)}")


def hold(path: Path, who: str):
    """The evidence directory's lock for this process's life, `who` written in it; Held when a live run holds it.
    Let go at exit, however Snakemake exits (refused after the Snakefile was read, failed or done)."""
    path = path.absolute()  # Snakemake's -d: the working directory is the process's only while the workflow runs
    f = take(path)
    f.seek(0)
    f.truncate()
    f.write(f"{who}\n")
    f.flush()
    atexit.register(let_go, f, path)
    return f


def share_workdir(path: Path = WORKDIR) -> tuple[object, int | None]:
    """Join the working directory's shared lock for this process's life: (its file, the number of Snakemake lock files
    removed, or None where another run is live and its locks are real)."""
    path = path.absolute()  # as in `hold`
    try:
        f = take(path)
    except Held:
        f, removed = take(path, fcntl.LOCK_SH), None  # waits only while a newcomer, alone, clears
    else:
        stale = list(SNAKEMAKE_LOCKS.glob("*.lock"))
        for lock in stale:
            lock.unlink()
        removed = len(stale)
        for lock in LOCKS.glob("*/*.lock"):  # a killed run's file: taken and removed (prune may hold one)
            with contextlib.suppress(Held):
                let_go(take(lock), lock)
        fcntl.flock(f, fcntl.LOCK_SH)
    atexit.register(_leave_workdir, f, path)
    return f, removed


def _leave_workdir(f, path: Path) -> None:
    try:  # the last to leave removes it (Snakemake's own locks are gone by now)
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
    else:
        let_go(f, path)


def live_runs(mine: Path | None = None, workdir: Path = Path()) -> list[str]:
    """What the evidence locks held by live runs say; `mine` (this run's) left out."""
    out = []
    for lock in sorted((workdir / LOCKS).glob("*/*.lock")):
        if mine is not None and lock.resolve() == (workdir / mine).resolve():
            continue
        who = holder(lock)
        if who is not None:  # held: its run is live
            out.append(who or "pid unknown")
    return out


def refusal(mine: Path | None = None, workdir: Path = Path()) -> str:
    """Why Snakemake cannot lock the working directory while another run is live, naming that run."""
    runs = live_runs(mine, workdir) or ["a run that writes no evidence directory (a sealed campaign's), or another "
                                        "workflow's"]
    return (f"Error: Directory cannot be locked: another run is live in this working directory ({workdir.absolute()}) "
            "and has locked files that this one would write too (every campaign's run rewrites evidence/index.html):\n"
            + "".join(f"  {r}\n" for r in runs)
            + "Wait for it to end (or stop it), then run again. Do not run --unlock: it is only for the locks of a run "
              "that was killed, and evident removes those itself once no run is live; while this one runs, it would "
              "let two runs write the same files.")


def name_live_runs(mine: Path | None = None) -> None:
    """Snakemake refuses to lock a directory whose files another run has locked, advising `--unlock`, which while that
    run is live lets two runs write the same files: its refusal (a LockException, made where it is raised) says
    `refusal` instead, read then."""
    from snakemake.exceptions import LockException, WorkflowError

    workdir = Path.cwd()
    LockException.__init__ = lambda self: WorkflowError.__init__(self, refusal(mine, workdir))
