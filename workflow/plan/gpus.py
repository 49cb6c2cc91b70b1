"""Local GPU assignment: each GPU job of a local run gets its own devices (CUDA_VISIBLE_DEVICES).

Snakemake counts GPUs (`--resources gpu=N` caps the sum of the running jobs' `gpu`) but never says which;
a cluster scheduler does (Slurm sets CUDA_VISIBLE_DEVICES for the `--gpus` of each job). A GPU rule runs
its stage through this module:

    python -m evident.workflow.plan.gpus N -- python -m evident.workflow.stages.X ...

A local run's Snakemake process exports its device pool (`export_pool`, called by rules/common.smk):
`EVIDENT_GPU_POOL=<ids>@<its host>:<its pid>`. A job that descends from that process takes N free devices
of the pool, one flock each (`.evident/gpus/<id>.lock` in the working directory, held by the stage's
process for its whole life and dropped by the kernel when it ends, however it ends), exports
CUDA_VISIBLE_DEVICES and execs the stage. Snakemake's own count keeps the locks free; if they are not
(a second run in the same working directory), the job waits for devices instead of sharing one. A job
that does not descend from that process (a Slurm job, whose devices Slurm chose) or a stage run by hand
execs the stage unchanged.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from evident.workflow.core.locks import try_flock

POOL_ENV = "EVIDENT_GPU_POOL"
LOCKS = Path(".evident/gpus")


def visible() -> list[str] | None:
    """The devices this process may use: CUDA_VISIBLE_DEVICES when set, else nvidia-smi's GPUs; None when
    unknown (no CUDA_VISIBLE_DEVICES and no nvidia-smi)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def smallest_memory() -> int | None:
    """Bytes of the smallest GPU nvidia-smi lists (of those CUDA_VISIBLE_DEVICES names, by index, where set);
    None without nvidia-smi. Asked of nvidia-smi, not torch: the Snakemake process that checks a campaign must
    not hold a CUDA context of its own through the run."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = dict(tuple(f.strip() for f in line.split(",")) for line in out.splitlines() if line.count(",") == 1)
    names = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    chosen = [sizes[d] for d in names if d in sizes] if names else list(sizes.values())
    return min(int(mib) << 20 for mib in chosen) if chosen else None


def pool(size: int | None) -> list[str] | None:
    """The local run's devices: the first `size` visible ones (`--resources gpu=size`), else all visible
    (None when unknown). With `size` and nothing known about the machine (no nvidia-smi, no
    CUDA_VISIBLE_DEVICES), ids 0..size-1: the scheduler's count is all there is to go by.
    """
    seen = visible()
    if size is None:
        return seen
    if seen is None:
        return [str(i) for i in range(size)]
    return seen[:size]  # fewer than `size` visible: jobs wait for a free one rather than share it


def export_pool(size: int | None) -> list[str] | None:
    """Called once by the Snakemake process of a run: its pool, for the GPU jobs it starts itself.

    Without a known device (no GPU found, and no `--resources gpu`) nothing is exported: jobs run unchanged.
    """
    ids = pool(size)
    if ids:
        os.environ[POOL_ENV] = f"{','.join(ids)}@{socket.gethostname()}:{os.getpid()}"
    else:
        os.environ.pop(POOL_ENV, None)
    return ids


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rpartition(")")[2].split()[1])  # the field after the command name is the state, then ppid
        out.append(pid)
    return out


def assigned_pool() -> list[str] | None:
    """The pool this job takes devices from, or None when its devices are not ours to assign."""
    value = os.environ.get(POOL_ENV)
    if not value or "@" not in value:
        return None
    ids, _, owner = value.rpartition("@")
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) not in _ancestors(os.getpid()):
        return None  # exported by a Snakemake process that did not start this job: a cluster job
    return [d for d in ids.split(",") if d]


def acquire(n: int, devices: list[str], locks: Path = LOCKS, poll: float = 0.5) -> list[tuple[str, object]]:
    """n devices of `devices`, each held by an exclusive flock; waits while fewer than n are free."""
    if n > len(devices):
        raise ValueError(f"a job needs {n} GPU(s), the local pool has {len(devices)} ({', '.join(devices) or 'none'}): "
                         f"run with --resources gpu={n} or more, on a machine with them")
    locks.mkdir(parents=True, exist_ok=True)
    said = False
    while True:
        held = []
        for dev in devices:
            f = try_flock(locks / f"{dev}.lock")  # exclusive, never waiting
            if f is None:
                continue
            held.append((dev, f))
            if len(held) == n:
                return held
        for _, f in held:  # never hold part of a request while waiting: two waiters cannot deadlock
            f.close()
        if not said:
            print(f"evident: waiting for {n} free GPU(s) of {','.join(devices)} (held by other jobs)",
                  file=sys.stderr, flush=True)
            said = True
        time.sleep(poll * (1 + random.random()))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.exit("usage: python -m evident.workflow.plan.gpus N -- COMMAND [ARGS...]")
    n, command = int(argv[0]), argv[2:]
    devices = assigned_pool()
    if n > 0 and devices is not None:
        try:
            held = acquire(n, devices)
        except ValueError as e:
            sys.exit(f"evident: {e}")
        ids = ",".join(dev for dev, _ in held)
        for _, f in held:
            os.set_inheritable(f.fileno(), True)  # the stage's process holds the locks until it ends
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()}\n")
            f.flush()
        os.environ["CUDA_VISIBLE_DEVICES"] = ids
        print(f"evident: CUDA_VISIBLE_DEVICES={ids} (local pool {','.join(devices)})", file=sys.stderr, flush=True)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
