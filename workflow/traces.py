"""Token traces: where two greedy generations part."""

from __future__ import annotations


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First step at which two traces differ (one stopping early differs at its length); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def token_at(trace: list[int], step: int) -> int | None:
    """The token at `step`, or None where the trace had already ended."""
    return trace[step] if step < len(trace) else None


def markdown(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table (pull-request summaries)."""
    from tabulate import tabulate

    return tabulate(rows, headers=header, tablefmt="github", disable_numparse=True)
