"""What a new user's install meets: the declared ranges resolve from the public registry on every supported platform,
the lock covers them, this machine keeps its CPU build of torch, and no folder of this project shadows another
package (Hugging Face's `kernels`, which transformers imports).

The resolutions ask the registry for metadata only (uv's resolver, no wheel downloaded): a few seconds each."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
# (uv's name of the platform, what the README's table calls it); macOS 14 is the oldest torch's arm64 wheels take
PLATFORMS = [("x86_64-manylinux_2_28", "Linux x86_64"), ("aarch64-manylinux_2_28", "Linux aarch64"),
             ("aarch64-apple-darwin", "macOS arm64")]
PYTHONS = ["3.11", "3.12"]


def resolve(requirements: Path, platform: str, python: str, *constraints: Path) -> subprocess.CompletedProcess:
    """uv's resolution of `requirements` (pyproject.toml with every extra, or a requirements file) for one platform
    and Python, against the public registry (uv's default index; no local wheel folder, no pip configuration)."""
    extras = ["--all-extras"] if requirements.suffix == ".toml" else []
    cmd = [sys.executable, "-m", "uv", "pip", "compile", "-q", "--no-header", *extras, str(requirements),
           "--python-platform", platform, "--python-version", python, *[a for c in constraints for a in ("-c", str(c))]]
    env = {**os.environ, "MACOSX_DEPLOYMENT_TARGET": "14.0", "UV_NO_CONFIG": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


@pytest.fixture(scope="module")
def resolutions() -> dict:
    """Every platform and Python, the ranges alone and with the lock: at once (each waits on the registry)."""
    jobs = {(p, v, lock): (REPO / "pyproject.toml", p, v, *([LOCK] if lock else []))
            for p, _ in PLATFORMS for v in PYTHONS for lock in (False, True)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        return dict(zip(jobs, pool.map(lambda args: resolve(*args), jobs.values())))


@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("platform", [p for p, _ in PLATFORMS])
def test_the_declared_dependencies_and_the_lock_resolve_on_every_supported_platform(resolutions, platform, python):
    r = resolutions[platform, python, False]
    assert r.returncode == 0, f"pyproject.toml does not resolve for {platform}, Python {python}:\n{r.stderr}"
    r = resolutions[platform, python, True]
    assert r.returncode == 0, f"requirements.lock does not install on {platform}, Python {python}:\n{r.stderr}"


def test_the_resolution_check_fails_naming_the_conflict_of_a_pin_against_torchs_own(tmp_path):
    # the pins this project once declared: torch 2.13.0 brings triton 3.7.1 on Linux
    (tmp_path / "requirements.in").write_text("torch==2.13.0\ntriton==3.6.0\n")
    r = resolve(tmp_path / "requirements.in", "x86_64-manylinux_2_28", "3.11")
    assert r.returncode != 0
    assert "triton==3.6.0" in r.stderr and "torch==2.13.0" in r.stderr, r.stderr


def locked() -> dict[str, list[tuple[str, str]]]:
    """requirements.lock as {name: [(version, marker)]} (a universal lock: a name may have one pin per marker)."""
    pins: dict[str, list[tuple[str, str]]] = {}
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)\s*(?:;\s*(.*))?$", line)
        if m:
            pins.setdefault(canonicalize_name(m[1]), []).append((m[2], m[3] or ""))
    return pins


def test_the_lock_pins_a_version_inside_every_declared_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    pins = locked()
    for text in declared:
        req = Requirement(text)
        if canonicalize_name(req.name) == "evident":
            continue  # an extra naming another extra
        assert canonicalize_name(req.name) in pins, f"{req.name} is declared but not locked: run `make lock`"
        for version, _ in pins[canonicalize_name(req.name)]:
            assert req.specifier.contains(version, prereleases=True), \
                f"the lock's {req.name}=={version} is outside pyproject's {text!r}: run `make lock`"


def local_cpu_torch() -> str | None:
    """The version of a CPU build of torch for this Python in pip's find-links (this machine's pip configuration
    has one on disk), or None."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    folders += [w for line in out.splitlines() if ".find-links=" in line
                for w in line.split("=", 1)[1].strip("'\"").split()]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in folders:
        for wheel in Path(folder.removeprefix("file://")).glob(f"torch-*+cpu-{tag}-*.whl"):
            return wheel.name.split("-")[1]
    return None


def test_where_pip_finds_a_cpu_torch_on_disk_the_lock_takes_it_and_so_did_the_install():
    cpu = local_cpu_torch()
    if cpu is None:
        pytest.skip("pip's find-links hold no CPU build of torch here: the lock's torch comes from the registry")
    version = cpu.split("+")[0]
    assert [v for v, _ in locked()["torch"]] == [version], \
        f"requirements.lock must pin torch {version}, the CPU build on this disk, or `make` downloads a CUDA build"
    assert metadata.version("torch") == cpu


def test_hugging_faces_kernels_is_found_from_the_repository_root_and_the_engine_still_finds_its_own():
    """Run as the rules run a stage: from the repository's root, where Python puts the working directory first on
    sys.path. transformers (5.25 on) depends on Hugging Face's `kernels` and imports it."""
    assert metadata.version("kernels"), "Hugging Face's kernels is not installed: this test shows nothing"
    code = ("import sys, kernels, transformers.integrations.hub_kernels, evident.kernels.gemv as gemv\n"
            "from transformers.utils.import_utils import is_kernels_available\n"
            "print(kernels.__file__, gemv.__file__, is_kernels_available(), 'kernels' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    theirs, ours, available, imported = r.stdout.split()
    assert Path(theirs).parent != REPO / "kernels" and "site-packages" in Path(theirs).parts, theirs
    assert Path(ours) == REPO / "kernels/gemv.py"
    assert available == imported == "True"


@pytest.mark.parametrize("name", ["engine", "kernels", "workflow"])
def test_no_folder_of_the_project_is_a_top_level_package(name):
    """A folder without __init__.py is only a namespace portion: any installed package of its name comes first."""
    assert not (REPO / name / "__init__.py").exists()
    wheel = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p.startswith("evident.") for p in wheel["packages"])
    assert set(wheel["package-dir"].values()) == {"engine", "kernels", "workflow"}


def test_make_run_says_what_it_installs_before_the_long_quiet_install(tmp_path):
    """pip runs quiet for minutes on a first `make run`: a line first says what is happening (make -n prints the
    recipes of a fresh virtual environment without running them)."""
    r = subprocess.run(["make", "-n", "run", f"VENV={tmp_path}/venv"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    say = next(i for i, line in enumerate(lines) if "evident: installing the locked dependencies" in line)
    pip = next(i for i, line in enumerate(lines) if "pip install" in line)
    assert say < pip and "-c requirements.lock" in lines[pip]
    assert not (tmp_path / "venv").exists()
