"""Arithmetic word problems in the GSM8K answer format, from a seeded generator: what a trained checkpoint
learns (`checkpoint.source: trained`) and what the quality gate asks it (`quality.gsm8k.source: generated`).

A problem is a template, a name, an object and two numbers; its answer is `a op b = c` then `#### c`. Every
question belongs to one split, decided by the sha256 of its text (about one in eight is `test`), so a
held-out question is never a training one whatever the seeds: the split is a property of the text.
"""

from __future__ import annotations

import hashlib
import random

NAMES = ("Sam", "Mia", "Leo", "Ann", "Tom", "Ivy", "Max", "Zoe", "Ben", "Eva", "Kai", "Lily")
OBJECTS = ("apple", "pen", "card", "book", "egg", "coin", "shell", "cup", "ball", "sock")
# (op, question, the numbers it draws): each a wording of one operation
TEMPLATES = (
    ("+", "{n} has {a} {o}s and gets {b} more. How many {o}s does {n} have?", (1, 9), (1, 9)),
    ("+", "{n} found {a} {o}s on Monday and {b} on Tuesday. How many {o}s in all?", (1, 9), (1, 9)),
    ("-", "{n} had {a} {o}s and gave away {b}. How many {o}s are left?", (2, 9), (1, 9)),
    ("-", "There were {a} {o}s and {n} took {b}. How many {o}s remain?", (2, 9), (1, 9)),
    ("*", "A box holds {a} {o}s. How many {o}s are in {b} boxes?", (2, 9), (2, 9)),
    ("*", "{n} buys {b} bags of {a} {o}s. How many {o}s is that?", (2, 9), (2, 9)),
)
TEST_EIGHTHS = 1  # the share of questions (by text hash) held out for testing, in eighths


def split_of(question: str) -> str:
    return "test" if hashlib.sha256(question.encode()).digest()[0] < 32 * TEST_EIGHTHS else "train"


def draw(rng: random.Random) -> dict:
    op, text, (alo, ahi), (blo, bhi) = rng.choice(TEMPLATES)
    a, b = rng.randint(alo, ahi), rng.randint(blo, bhi)
    if op == "-" and b >= a:
        a, b = b + 1, a  # answers stay positive: a - b >= 1
    c = a + b if op == "+" else a - b if op == "-" else a * b
    q = text.format(n=rng.choice(NAMES), o=rng.choice(OBJECTS), a=a, b=b)
    return {"question": q, "answer": f"{a} {op} {b} = {c}\n#### {c}"}


def stream(seed: int, split: str):
    """Endless problems of one split, in the order `seed` gives."""
    rng = random.Random(f"evident-arithmetic:{seed}:{split}")
    while True:
        p = draw(rng)
        if split_of(p["question"]) == split:
            yield p


def problems(seed: int, split: str, n: int, distinct: bool = True) -> list[dict]:
    """The first n problems of `stream(seed, split)`; `distinct` skips a question already drawn."""
    out, seen = [], set()
    for p in stream(seed, split):
        if len(out) == n:
            return out
        if distinct and p["question"] in seen:
            continue
        seen.add(p["question"])
        out.append(p)
    return out
