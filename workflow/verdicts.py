"""The parity verdicts, mildest first (the worst cell's is the campaign's), and those that fail the run."""

SEVERITY = ["all_token_text_exact", "near_tie_divergence", "precision_regression", "engine_accuracy_gap",
            "transport_regression", "batch_row_mismatch"]
# what the gate fails the run on after sealing; `parity.require_exact` adds near_tie_divergence
DEFECTS = SEVERITY[2:]


def worst(verdicts) -> str:
    return max(verdicts, key=SEVERITY.index)
