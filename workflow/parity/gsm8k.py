"""GSM8K-64: data (embedded, generated, local with pinned sha256, or the hub), the prompt contract, answer extraction
and normalisation, scoring and the quality gate. Pure functions over plain data; the stage runs targets.

Conventions of public harnesses: first `limit` test rows, `shots` examples from the start of train,
`Question: {q}\\nAnswer: {a}` shots joined by a blank line, then `Question: {q}\\nAnswer:`; greedy; the
completion ends at the first stop string. Strict extraction: the first `#### N`; flexible: the last number.
Normalisation: commas, `$` and a trailing period removed, then a number written canonically (72.0 -> 72).
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

from evident.workflow.core.evidence import sha256_bytes, sha256_file
from evident.workflow.parity.traces import REPLACEMENT, UNDECODABLE

OFFICIAL_SHA256 = {"test": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
                   "train": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465"}
HUB_REPO = "openai/gsm8k"

# The embedded set: GSM8K-format rows written by this project (short, so a tiny model's context holds
# the shots), so the default campaign needs no download. Its bytes are canonical JSONL (below) with
# the pinned hashes EMBEDDED_SHA256; a test recomputes them.
EMBEDDED = {
    "train": [
        ("Ann has 3 pens. She buys 4 more. How many pens does she have?", "3 + 4 = 7\n#### 7"),
        ("A box holds 6 eggs. How many eggs are in 5 boxes?", "6 * 5 = 30\n#### 30"),
        ("Tom had 20 dollars and spent 8. How much is left?", "20 - 8 = 12\n#### 12"),
        ("12 cookies are shared by 4 kids. How many does each get?", "12 / 4 = 3\n#### 3"),
        ("A bus has 15 seats and 9 are taken. How many are free?", "15 - 9 = 6\n#### 6"),
    ],
    "test": [
        ("Sam has 5 apples and gets 6 more. How many apples?", "5 + 6 = 11\n#### 11"),
        ("A pack has 8 pencils. How many pencils in 3 packs?", "8 * 3 = 24\n#### 24"),
        ("Mia had 40 dollars and spent 15. How much is left?", "40 - 15 = 25\n#### 25"),
        ("18 cards are shared by 3 kids. How many each?", "18 / 3 = 6\n#### 6"),
        ("A shelf holds 9 books. How many books on 4 shelves?", "9 * 4 = 36\n#### 36"),
        ("Leo ran 7 km on Monday and 8 km on Tuesday. How far in all?", "7 + 8 = 15\n#### 15"),
        ("A cake costs 1,200 cents. What do 2 cakes cost in cents?", "1200 * 2 = 2400\n#### 2,400"),
        ("It is 3 degrees and falls by 5. What is the temperature?", "3 - 5 = -2\n#### -2"),
    ],
}
EMBEDDED_SHA256 = {"test": "6d93d0ba13cab5c6c8ccfb0ecd555644d50df9386e5184e933f5fb6ab65c2401",
                   "train": "d4138ca26f12caf8d8f4fc13463d4fa3df596f87b838d7d2b590822826b64c13"}

# source generated: held-out problems of workflow/models/arithmetic.py's test split (never a training question of a
# trained checkpoint: the split is a property of the text), the shots from its train split
GENERATED_ROWS = {"test": 64, "train": 8}

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")


class DataError(ValueError):
    """A data file is missing, unreadable or not the pinned one; the message names the key and what to do."""


# --- data --------------------------------------------------------------------------------------

def embedded_bytes(split: str) -> bytes:
    return "".join(json.dumps({"question": q, "answer": a}, ensure_ascii=False) + "\n"
                   for q, a in EMBEDDED[split]).encode("utf-8")


def parse_jsonl(data: bytes, where: str) -> list[dict]:
    rows = []
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: line {n} is not JSON ({e.msg})") from e
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
            raise DataError(f"{where}: line {n} lacks string fields `question` and `answer`")
        rows.append({"question": row["question"], "answer": row["answer"]})
    return rows


def load_split(cfg: dict, split: str, path: str | Path | None = None) -> tuple[list[dict], dict]:
    """Rows and the data manifest entry {name, source, sha256, bytes, rows} of one split; checked against
    the pinned sha256 (`quality.gsm8k.<split>_sha256`)."""
    key = f"quality.gsm8k.{split}"
    source = cfg["source"]
    if source == "embedded":
        data, name = embedded_bytes(split), f"embedded-{split}.jsonl"
        pinned = EMBEDDED_SHA256[split]
    elif source == "generated":
        from evident.workflow.models import arithmetic

        rows = arithmetic.problems(cfg["seed"], split, GENERATED_ROWS[split])
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
        return rows, {"name": f"generated-{split}.jsonl", "source": "generated", "seed": cfg["seed"],
                      "generator": "workflow/models/arithmetic.py", "sha256": sha256_bytes(data), "bytes": len(data),
                      "rows": len(rows)}
    elif source == "local":
        raw = path or cfg.get(split)
        if not raw:
            raise DataError(f"{key}: source is local but no file is set; set {key} to a GSM8K JSONL file")
        path = Path(raw)
        if not path.is_file():
            raise DataError(f"{key}: {path.name or path} not found; set {key} to a GSM8K JSONL file "
                            f"(the official {split}.jsonl of {HUB_REPO}, checked against {split}_sha256)")
        data, name = path.read_bytes(), path.name
        pinned = cfg.get(f"{split}_sha256") or OFFICIAL_SHA256[split]
    elif source == "hub":
        return _load_hub(cfg, split)
    else:
        raise DataError(f"quality.gsm8k.source: unknown source {source!r}")
    got = sha256_bytes(data)
    if got != pinned:
        raise DataError(f"{key}: sha256 {got[:12]}… of {name} != pinned {pinned[:12]}…; use the pinned file or set "
                        f"{key}_sha256 to the hash of the data you mean to evaluate")
    rows = parse_jsonl(data, f"{key} ({name})")
    return rows, {"name": name, "source": source, "sha256": got, "bytes": len(data), "rows": len(rows)}


def _load_hub(cfg: dict, split: str) -> tuple[list[dict], dict]:
    """The Hugging Face dataset openai/gsm8k (config `main`), one parquet file per split at a pinned revision."""
    from huggingface_hub import hf_hub_download

    key = f"quality.gsm8k.{split}"
    revision = cfg.get("revision") or "main"
    try:
        p = hf_hub_download(HUB_REPO, f"main/{split}-00000-of-00001.parquet", repo_type="dataset", revision=revision)
    except Exception as e:  # noqa: BLE001 - offline, not found, ...
        raise DataError(f"{key}: could not fetch {HUB_REPO}@{revision} ({type(e).__name__}); use source local or "
                        f"embedded without a network") from e
    import pandas as pd

    got = sha256_file(p)
    pinned = cfg.get(f"{split}_sha256")
    if pinned and pinned != OFFICIAL_SHA256[split] and got != pinned:
        raise DataError(f"{key}: sha256 {got[:12]}… of the hub parquet != pinned {pinned[:12]}…")
    df = pd.read_parquet(p)
    rows = [{"question": q, "answer": a} for q, a in zip(df["question"], df["answer"])]
    return rows, {"name": f"{HUB_REPO}@{revision}:{split}", "source": "hub", "sha256": got,
                  "bytes": Path(p).stat().st_size, "rows": len(rows)}


# --- prompts -----------------------------------------------------------------------------------

def contract(cfg: dict) -> dict:
    """What every target must run identically (recorded; the gate refuses to compare different ones)."""
    return {"limit": cfg["limit"], "shots": cfg["shots"], "format": "Question: {question}\\nAnswer:",
            "shot_format": "Question: {question}\\nAnswer: {answer}", "shot_delimiter": "\\n\\n",
            "decoding": "greedy", "max_tokens": cfg["max_tokens"], "stop": list(cfg["stop"]),
            "match": cfg["match"], "strict": STRICT.pattern, "flexible": "last number " + NUMBER.pattern,
            "normalise": "remove commas, $ and a trailing period; numbers canonical (72.0 -> 72)"}


def build_prompts(test: list[dict], train: list[dict], limit: int, shots: int) -> list[dict]:
    if shots > len(train):
        raise DataError(f"quality.gsm8k.shots: {shots} shots, but train has {len(train)} rows")
    head = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in train[:shots])
    return [{"id": i, "prompt": f"{head}Question: {r['question']}\nAnswer:", "gold": gold(r["answer"])}
            for i, r in enumerate(test[:limit])]


# --- extraction and normalisation --------------------------------------------------------------

def normalise(s: str | None) -> str | None:
    if s is None:
        return None
    s = s.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    if not s:
        return None
    try:
        d = Decimal(s)
    except InvalidOperation:
        return s
    if not d.is_finite():
        return s
    d = d.normalize()
    out = format(d, "f")
    return "0" if out in ("-0", "0") else out


def gold(answer: str) -> str | None:
    m = STRICT.search(answer)
    return normalise(m.group(1)) if m else None


def extract_strict(text: str) -> str | None:
    m = STRICT.search(text)
    return normalise(m.group(1)) if m else None


def extract_flexible(text: str) -> str | None:
    found = NUMBER.findall(text)
    return normalise(found[-1]) if found else None


def truncate(text: str, stops: list[str]) -> str:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(hits)] if hits else text


def score(items: list[dict], completions: list[str], match: str) -> tuple[list[dict], dict]:
    rows, totals = [], {"strict": [0, 0], "flexible": [0, 0]}
    from evident.workflow.core.evidence import text_sha256

    for it, text in zip(items, completions):
        ex = {"strict": extract_strict(text), "flexible": extract_flexible(text)}
        for k, v in ex.items():
            totals[k][0] += v is not None and v == it["gold"]
            totals[k][1] += v is None
        rows.append({"id": it["id"], "prompt_sha256": text_sha256(it["prompt"]), "completion": text,
                     "extracted": ex[match], "extracted_strict": ex["strict"], "extracted_flexible": ex["flexible"],
                     "gold": it["gold"], "ok": ex[match] is not None and ex[match] == it["gold"]})
    n = len(items)
    summary = {"n": n, "correct": totals[match][0], "invalid": totals[match][1],
               "accuracy": totals[match][0] / n if n else 0.0,
               "by_match": {k: {"correct": c, "invalid": i, "accuracy": c / n if n else 0.0}
                            for k, (c, i) in totals.items()}}
    return rows, summary


# --- the gate ----------------------------------------------------------------------------------

def replacement_only(a: str, b: str) -> bool:
    """a and b differ, and only where one side has U+FFFD characters and the other nothing."""
    return a != b and a.replace(REPLACEMENT, "") == b.replace(REPLACEMENT, "")


def gate(reference: dict, candidate: dict, ref_rows: list[dict], cand_rows: list[dict], tolerance: int,
         fail_on_flips: bool, random_weights: bool = False) -> dict:
    """Candidate against reference. `refused` unless the same data and contract. `no_claim` when the reference gave
    no valid answer (nothing to compare against), or on random weights unless every completion is identical: there
    accuracy means nothing, and identical text is the one claim that holds. Otherwise `pass` when correct >=
    reference correct - tolerance and invalid <= reference invalid, else `fail`; flips (reference right, candidate
    wrong) are listed and fail the gate (`fail_flips`) when fail_on_flips."""
    out = {"reference": reference["target"], "candidate": candidate["target"], "tolerance": tolerance,
           "fail_on_flips": fail_on_flips}
    why = []
    if reference["data"] != candidate["data"]:
        why.append("data hashes differ")
    if reference["contract"] != candidate["contract"]:
        diff = sorted(k for k in set(reference["contract"]) | set(candidate["contract"])
                      if reference["contract"].get(k) != candidate["contract"].get(k))
        why.append("contract differs (" + ", ".join(diff) + ")")
    if why:
        return {**out, "verdict": "refused", "reason": "refused to compare: " + "; ".join(why), "flips": [],
                "gains": [], "same_completion": None, "compared": None}
    ref_of = {r["id"]: r for r in ref_rows}
    flips = [{"id": r["id"], "gold": r["gold"], "reference": ref_of[r["id"]]["extracted"], "candidate": r["extracted"]}
             for r in cand_rows if ref_of[r["id"]]["ok"] and not r["ok"]]
    gains = [r["id"] for r in cand_rows if r["ok"] and not ref_of[r["id"]]["ok"]]
    differ = [r["id"] for r in cand_rows if r["completion"] != ref_of[r["id"]]["completion"]]
    # differing only in U+FFFD: still different text (never counted as identical), named apart with its cause
    fffd = [r["id"] for r in cand_rows if replacement_only(r["completion"], ref_of[r["id"]]["completion"])]
    n, same = len(cand_rows), len(cand_rows) - len(differ)
    rc, cc = reference["correct"], candidate["correct"]
    ri, ci = reference["invalid"], candidate["invalid"]
    hint = (f"{len(fffd)}/{n} differ only in U+FFFD characters (one side has U+FFFD where the other has nothing: "
            f"{UNDECODABLE}), not counted as identical" if fffd else "")
    counts = f"correct {cc} vs {rc}, invalid {ci} vs {ri}, identical completions {same}/{n}" + (f"; {hint}" if hint else "")
    if ri == n:
        verdict = "no_claim"
        reasons = [f"the reference gave no valid answer on {n} questions"
                   + (" and neither did the candidate" if ci == n else f" (the candidate gave {n - ci})")
                   + ": nothing comparable"]
        compared = "nothing: the reference has no valid answer"
    elif random_weights:
        compared = "completions, text for text (random weights: accuracy means nothing)"
        if differ:
            verdict = "no_claim"
            reasons = [f"random weights, and the completions differ on {len(differ)}/{n} questions "
                       f"({', '.join(f'q{i}' for i in differ[:8])}{', …' if len(differ) > 8 else ''})"
                       + (f", {hint}" if hint else "")
                       + ": accuracy on random weights compares nothing, so no claim is made"]
        else:
            verdict, reasons = "pass", [f"random weights: identical completions on every question ({n}/{n})"]
    else:
        compared = (f"extracted answers ({reference['contract']['match']} match) against gold: correct >= reference "
                    f"- {tolerance}, invalid <= reference" + ("; any flip fails" if fail_on_flips else ""))
        reasons = []
        if cc < rc - tolerance:
            reasons.append(f"correct {cc} < reference {rc} - tolerance {tolerance}")
        if ci > ri:
            reasons.append(f"invalid {ci} > reference {ri}")
        if reasons:
            verdict = "fail"
        elif flips and fail_on_flips:
            verdict, reasons = "fail_flips", [f"{len(flips)} flip(s) (reference right, candidate wrong) and fail_on_flips is set"]
        else:
            verdict = "pass"
            reasons = [f"correct {cc} >= {rc} - {tolerance}, invalid {ci} <= {ri}"
                       + (f"; {len(flips)} flip(s) listed, not failing (fail_on_flips off)" if flips else "; no flips")]
    return {**out, "verdict": verdict, "reason": "; ".join(reasons), "compared": compared, "counts": counts,
            "flips": flips, "gains": gains, "differ": differ, "same_completion": same, "replacement_only": fffd,
            "rows": n}
