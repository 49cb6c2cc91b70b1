"""The import direction, read from the source with ast (top-level and function-local imports alike, so a lazy import
cannot hide an edge): kernels/ imports nothing of the engine or the workflow, engine/ nothing of the workflow, and no
project module imports itself back through others. With no cycle among both kinds together, no function-local import
is there to dodge one: those left load Triton or a heavy dependency late, and say so."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"engine": "evident.engine", "kernels": "evident.kernels", "workflow": "evident.workflow"}


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))}


def _module(name: str) -> str | None:
    """The project module ``name`` is, or is an attribute of; None outside the project."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, module: str) -> set[str]:
    """The project modules that ``module`` (its source at ``path``) imports anywhere in it."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + [base] if base else up)
            names += [base] + [f"{base}.{a.name}" for a in node.names]  # a name may be a module of the package
    return {m for m in map(_module, names) if m and m != module}


GRAPH = {m: imports(p, m) for m, p in MODULES.items()}


@pytest.mark.parametrize("layer,above", [("evident.kernels", ("evident.engine", "evident.workflow")),
                                         ("evident.engine", ("evident.workflow",))])
def test_layers_import_downwards(layer, above):
    wrong = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith(layer + ".") for t in ts
                   if t.startswith(tuple(a + "." for a in above)))
    assert not wrong, wrong


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first again at the end), or None."""
    done, path = set(), []

    def visit(m):
        path.append(m)
        for t in sorted(graph[m]):
            if t in path:
                return path[path.index(t):] + [t]
            if t not in done and (found := visit(t)):
                return found
        done.add(path.pop())

    return next((found for m in sorted(graph) if m not in done and (found := visit(m))), None)


def test_no_import_cycle():
    assert cycle(GRAPH) is None, " -> ".join(cycle(GRAPH))


def test_the_checks_see_function_local_imports_and_cycles(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from .config import V4\n    from evident.kernels import head\n")
    assert imports(src, "evident.engine.x") == {"evident.engine.config", "evident.kernels.head"}
    found = cycle({**GRAPH, "evident.engine.config": GRAPH["evident.engine.config"] | {"evident.engine.model"}})
    assert found[0] == found[-1] and "evident.engine.config" in found


def _edges(source: str, target: str, allowed: str = "") -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith(source + ".") for t in ts
                  if _within(t, target) and not (allowed and _within(t, allowed)))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_workflow_core_imports_no_other_workflow_package():
    """core/ (the evidence directory's primitives) is what every other package stands on."""
    assert _edges("evident.workflow.core", "evident.workflow", allowed="evident.workflow.core") == []


def test_no_workflow_module_imports_a_stage():
    """A stage is a command line at the top: nothing imports one, another stage neither."""
    assert _edges("evident.workflow", "evident.workflow.stages") == []
