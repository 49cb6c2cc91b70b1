"""The campaign's kernel A/B screens: the built-in one and the user's (`screens:`), each a factory `pkg.mod:factory`.

The overlap stage runs every screen the same way (kernels/overlap.py: the contract `Screen`, the bitwise check, the
timing). This module owns what the rest of the workflow knows of them: their names, their evidence files, loading
a factory from the user's code (the campaign's working directory, then PYTHONPATH), the checks before any work and
the hash of the user's code that the evidence id covers.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import sys
from pathlib import Path

from evident.workflow.core import layout

BUILTIN = "c4"  # the built-in screen: DeepSeek-V4's C4 auxiliary GEMVs (or the shapes the campaign states)
BUILTIN_FACTORY = "evident.kernels.overlap:c4_screen"


class FactoryError(ValueError):
    """A `screens:` module reference that does not give a factory; the message says what to do."""


def files(name: str) -> dict[str, str]:
    """A screen's evidence files (layout.screen_files: the built-in keeps the paths it had before there were others)."""
    return layout.screen_files(name, builtin=name == BUILTIN)


def load(ref: str):
    """The callable `ref` ("pkg.mod:factory") names, imported from the working directory or PYTHONPATH, as
    `python -m` in the working directory imports (the stage runs so); FactoryError naming the fix otherwise."""
    module, _, attr = ref.partition(":")
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise FactoryError(f"no module `{module}` in the campaign's working directory or on PYTHONPATH; put the "
                               "screen's package there or add its folder to PYTHONPATH") from None
        raise FactoryError(f"importing `{module}` failed: {e}") from None
    except Exception as e:  # the user's module raised while importing
        raise FactoryError(f"importing `{module}` raised {type(e).__name__}: {e}") from None
    finally:
        if added:
            sys.path.remove(here)
    factory = getattr(mod, attr, None)
    if factory is None:
        raise FactoryError(f"module `{module}` has no `{attr}`; name the function that returns the screen")
    if not callable(factory):
        raise FactoryError(f"`{ref}` is a {type(factory).__name__}, not callable; name a function `factory(device)` "
                           "that returns kernels.overlap.Screen")
    try:
        inspect.signature(factory).bind("cpu")
    except TypeError:
        raise FactoryError(f"`{ref}{inspect.signature(factory)}` cannot be called as factory(device); it takes the "
                           "device, \"cpu\" or \"cuda\", as its one argument") from None
    except ValueError:  # no signature to read (a builtin): calling it says
        pass
    return factory


def problems(config: dict) -> list[tuple[str, str]]:
    """(key, what) for each `screens:` entry that cannot run, before any work."""
    entries = config.get("screens") or []
    out = []
    if entries and "overlap" not in config["stages"]:
        out.append(("screens", "the screens run in the overlap stage, which `stages` leaves out; add overlap to "
                               "stages or remove screens"))
    seen = {}
    for i, e in enumerate(entries):
        if e["name"] == BUILTIN:
            out.append((f"screens.{i}.name", f"`{BUILTIN}` is the built-in screen's name; pick another"))
        elif e["name"] in seen:
            out.append((f"screens.{i}.name", f"`{e['name']}` names screens.{seen[e['name']]} too; names are unique"))
        seen.setdefault(e["name"], i)
        try:
            load(e["module"])
        except FactoryError as err:
            out.append((f"screens.{i}.module", str(err)))
    return out


def source_sha256(ref: str) -> str | None:
    """sha256 over the Python files of the package `ref` lives in (its top-level package's folder; a lone module's
    file), so that an edit to the user's kernels changes the evidence id as an edit to the project's own does; None
    when it does not load (the campaign check names why)."""
    try:
        load(ref)
    except FactoryError:
        return None
    parts = ref.partition(":")[0].split(".")
    # this project's own modules live one level down, in the `evident` namespace (evident.kernels, ...)
    top = sys.modules[".".join(parts[:2] if parts[0] == "evident" else parts[:1])]
    if getattr(top, "__path__", None):
        root = Path(list(top.__path__)[0])
        paths = sorted(root.rglob("*.py"))
    else:
        root, paths = Path(top.__file__).parent, [Path(top.__file__)]
    h = hashlib.sha256()
    for p in paths:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()
