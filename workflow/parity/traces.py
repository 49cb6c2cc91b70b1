"""Token traces: a generated row as parity records it, and where two greedy generations part."""

from __future__ import annotations

from evident.workflow.core.evidence import text_sha256, token_sha256

REPLACEMENT = "\ufffd"
# why two decodings of the same tokens may differ in U+FFFD only (parity's text level, the quality gate)
UNDECODABLE = ("bytes that are not UTF-8 on their own (a token that ends inside a character, common on random "
               "weights) are rendered differently: transformers decodes them to U+FFFD, vLLM and llama.cpp drop them")


def token_row(tok, ids: list[int]) -> dict:
    """A row of generated ids as the parity records hold it: its text (special tokens kept, so that it compares with
    the oracle's) and both hashes."""
    text = tok.decode(ids, skip_special_tokens=False)
    return {"generated_ids": ids, "text": text, "token_sha256": token_sha256(ids), "text_sha256": text_sha256(text)}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First step at which two traces differ (one stopping early differs at its length); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def token_at(trace: list[int], step: int) -> int | None:
    """The token at `step`, or None where the trace had already ended."""
    return trace[step] if step < len(trace) else None


def first_row_mismatch(rows: list) -> dict | None:
    """Where the first row of a same-prompt batch that is not row 0's parts from it: rows of token ids (`step`, both
    tokens) or of text (`char`, both texts from there)."""
    for r, row in enumerate(rows[1:], 1):
        at = first_difference(rows[0], row)
        if at is None:
            continue
        if isinstance(row, str):
            return {"row": r, "char": at, "row0_text": rows[0][at:at + 24], "row_text": row[at:at + 24]}
        return {"row": r, "step": at, "row0_token": token_at(rows[0], at), "row_token": token_at(row, at)}
    return None


def markdown(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table (pull-request summaries)."""
    from tabulate import tabulate

    return tabulate(rows, headers=header, tablefmt="github", disable_numparse=True)
