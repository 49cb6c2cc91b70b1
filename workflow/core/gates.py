"""The gates, once: the stage that decides each, the file its verdict is in, the verdicts that fail the run.

Read by the gate stage (which fails a sealed run on them), by seal (the manifest's `gates`) and by the archive.
The deciding stage tags its verdict `<gate>.verdict` on its stage record, and so in MLflow.
"""

from __future__ import annotations

from dataclasses import dataclass

from evident.workflow.core import layout
from evident.workflow.core.verdicts import DEFECTS, QUALITY, SEVERITY, SOAK

NOT_MEASURED = "not_measured"  # the overlap screens' verdict where nothing was timed
NOT_COMPILED = "not_compiled"  # the kernel audit's where no kernel was compiled (no GPU)


@dataclass(frozen=True)
class Gate:
    name: str
    stage: str  # the campaign's `stages:` entry that decides it
    file: str  # the evidence file whose top-level `verdict` is the gate's
    failing: frozenset[str]  # verdicts that fail the run (a document marked `advisory` fails nothing)
    what: str  # how a message names it
    fallback: str | None = None  # the file that holds the verdict in a directory without `file`
    idle: frozenset[str] = frozenset()  # verdicts that say the gate measured nothing: neither a pass nor a fail

    @property
    def tag(self) -> str:
        return f"{self.name}.verdict"

    def state(self, verdict: str | None) -> str:
        """`fail`, `pass` or `none` (not run, or it measured nothing): what a view colours red, green or grey."""
        if not verdict or verdict in self.idle:
            return NOT_RUN
        return "fail" if verdict in self.failing else "pass"

    def fails(self, verdict: str, config: dict) -> bool:
        """Whether the verdict fails the gate (an advisory document still fails nothing): one of its failing
        verdicts or, for parity under `parity.require_exact`, anything short of exact."""
        short = self.name == "parity" and config["parity"].get("require_exact") and verdict != EXACT
        return verdict in self.failing or bool(short)


NOT_RUN = "none"
EXACT = SEVERITY[0]  # parity's best verdict, all_token_text_exact


GATES = (
    # `parity.require_exact` adds near_tie_divergence (the gate stage)
    Gate("parity", "parity", layout.COMPARISON, frozenset(DEFECTS), "the parity verdict"),
    # any screen's bitwise_mismatch is the stage's (workflow/stages/overlap.py `stage_verdict`); a campaign without
    # screens of its own has the built-in's file only
    Gate("overlap", "overlap", layout.SCREENS, frozenset({"bitwise_mismatch"}),
         "the overlap A/B screens (outputs of A and B differ)", fallback=layout.screen_files("", True)["screen"],
         idle=frozenset({NOT_MEASURED})),
    Gate("audit", "kernel_audit", layout.AUDIT, frozenset({"spills"}),
         "the kernel resource audit (register spills)", idle=frozenset({NOT_COMPILED})),
    # no_claim fails too: nothing comparable happened, so nothing passed
    Gate("quality", "quality", layout.QUALITY_GATE, frozenset(QUALITY) - {"pass"}, "the GSM8K quality gate"),
    Gate("soak", "soak", layout.SOAK_GATE, frozenset(SOAK) - {"pass"},
         "the soak (errors, a server that died, memory growth)"),
)
BY_NAME = {g.name: g for g in GATES}


def document(gate: Gate, files) -> str | None:
    """The file among `files` (a directory's, relative) that holds the gate's verdict: its own, else its fallback."""
    return next((f for f in (gate.file, gate.fallback) if f and f in files), None)
PARITY = BY_NAME["parity"]


def target_verdicts(comparison: dict) -> dict[str, dict]:
    """Each engine target's verdict and level ({name: {verdict, level}}), from parity/comparison.json's `targets`."""
    return {n: {"verdict": t["verdict"], "level": t["level"]} for n, t in (comparison.get("targets") or {}).items()}


def verdicts(records: list[dict]) -> dict[str, str]:
    """{gate: verdict} from the stage records' `<gate>.verdict` tags, for the gates whose stage ran."""
    tags = {k: v for r in records for k, v in r.get("tags", {}).items()}
    tags.setdefault(PARITY.tag, tags.get("verdict"))  # directories sealed before the tags were named per gate
    return {g.name: tags[g.tag] for g in GATES if tags.get(g.tag) is not None}
