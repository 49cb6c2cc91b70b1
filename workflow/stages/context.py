"""Stage `context`: the resolved campaign config and the environment, first files of a directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from workflow import environment
from workflow.evidence import write_json, write_text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--evidence", required=True, type=Path, help="evidence directory")
    ap.add_argument("--config-json", required=True, help="the resolved campaign config as JSON")
    args = ap.parse_args(argv)
    config = json.loads(args.config_json)
    device = environment.resolve_device(config["device"])
    write_text(args.evidence / "config.yaml", yaml.safe_dump(config, sort_keys=True, allow_unicode=True))
    write_json(args.evidence / "env.json", environment.describe(device))
    print(f"[context] {args.evidence}: device {device}, dtype {config['dtype']}", flush=True)


if __name__ == "__main__":
    main()
