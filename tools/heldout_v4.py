"""Held-out tiny DeepSeek-V4 configs for the float32 parity check (issue 21): drawn from a seed nobody tuned the
engine on, each written as its own campaign (parity only, float32, `require_exact`) over config/campaigns/v4-tiny.yaml.
A config is 2-4 layers of random attention types (at least one compressed sparse and one heavily compressed), a
hash-routed MoE in the first 0-2 layers, random hyper-connection streams, indexer top-k, window and compression rates,
sqrtsoftplus or sigmoid scoring, seeded weights and, in about 40% of the draws, yarn on the compressed layers' rope.

    .venv/bin/python tools/heldout_v4.py --seed 20261202 --count 3 --out /tmp/heldout
    for f in /tmp/heldout/*.yaml; do .venv/bin/evident run -c2 --configfile "$f"; done
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evident.engine.config import CSA as C, HASH_MOE, HCA as H, MOE, SLIDING as S  # noqa: E402


def draw(rng: random.Random) -> dict:
    layers = rng.randint(2, 4)
    types = [C, H] + [rng.choice([S, C, H]) for _ in range(layers - 2)]
    rng.shuffle(types)
    hashed = rng.randint(0, min(2, layers - 1))
    cfg = {
        "num_hidden_layers": layers, "layer_types": types,
        "mlp_layer_types": [HASH_MOE] * hashed + [MOE] * (layers - hashed),
        "hc_mult": rng.randint(1, 4), "index_topk": rng.randint(1, 5), "sliding_window": rng.randint(4, 16),
        "compress_rates": {C: rng.randint(2, 4), H: rng.randint(5, 12)},
        "scoring_func": rng.choice(["sqrtsoftplus", "sigmoid"]), "num_experts_per_tok": rng.randint(1, 3),
    }
    if rng.random() < 0.4:
        cfg["rope_scaling"] = {"type": "yarn", "factor": rng.choice([2.0, 4.0, 8.0]), "original_max_position_embeddings": 64}
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--count", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    base = yaml.safe_load((REPO / "config/campaigns/v4-tiny.yaml").read_text())
    rng = random.Random(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    for i in range(a.count):
        over = draw(rng)
        camp = {**base, "campaign": f"heldout-v4-{a.seed}-{i}", "stages": ["parity"],
                "checkpoint": {**base["checkpoint"], "seed": rng.randrange(2**31), "config": over},
                "parity": {**base["parity"], "require_exact": True}}
        for k in ("bench", "overlap", "quality", "profile"):
            camp.pop(k, None)
        path = a.out / f"{camp['campaign']}.yaml"
        path.write_text(yaml.safe_dump(camp, sort_keys=False))
        print(path, over)


if __name__ == "__main__":
    main()
