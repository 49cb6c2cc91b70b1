"""The parity verdicts, mildest first (the worst cell's is the campaign's), and those that fail the run.

`text_only`: a target compared at text level only (its server took or returned no token ids) whose text equals the
oracle's: weaker than a token comparison, never counted as exact, not a defect (`parity.require_exact` fails it);
a text-level target whose text differs gets the margin rule's verdict, as a token-level one does.
`kv_cache_precision_gap`: a target that declares a KV cache below its compute dtype (`kv_cache_dtype`) and fails the
logic check: the cache's rounding, named as such rather than as wrong maths. `variant_mismatch`: two entries of a
variant pair (`agrees_with`) that part, token for token.
"""

# Below these top-1/top-2 margins two correct computations may pick different tokens: the floor of parity's
# `near_tie_margin` (workflow/parity/logprobs.py) and of the bench's rows check (workflow/bench/replay.py). For bf16, 0.5 is
# 8 ulps at |logit| 8-16: on the DeepSeek-V2-Lite shape (27 layers, H200) the engine disagreed with itself across
# batch sizes (different GEMM shapes) at a 4-ulp oracle margin (0.25).
NEAR_TIE = {"float32": 1e-4, "float16": 1.25e-1, "bfloat16": 5e-1}

SEVERITY = ["all_token_text_exact", "text_only", "near_tie_divergence", "precision_regression", "kv_cache_precision_gap",
            "engine_accuracy_gap", "transport_regression", "variant_mismatch", "batch_row_mismatch"]
# what the gate fails the run on after sealing; `parity.require_exact` adds the milder ones but exact
DEFECTS = SEVERITY[SEVERITY.index("precision_regression"):]


# The GSM8K quality gate's verdicts (workflow/parity/gsm8k.py `gate`), worst last: every one but pass fails the run
# unless the campaign sets quality.advisory.
QUALITY = ("pass", "no_claim", "fail", "fail_flips", "refused")


def worst(verdicts) -> str:
    return max(verdicts, key=SEVERITY.index)


# The soak gate's verdicts (workflow/stages/soak.py): fail where a target's soak had an error, its server died or its
# memory grew (each reason recorded).
SOAK = ("pass", "fail")
