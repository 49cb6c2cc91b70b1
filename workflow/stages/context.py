"""Stage `context`: the recorded campaign config and the environment, first files of a directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from evident.workflow import environment
from evident.workflow.evidence import Stage, write_text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--evidence", required=True, type=Path, help="evidence directory")
    ap.add_argument("--config-json", required=True, help="the recorded campaign config as JSON")
    args = ap.parse_args(argv)
    config = json.loads(args.config_json)
    with Stage(args.evidence, "context", params={"campaign": config["campaign"], "dtype": config["dtype"]}) as st:
        device = environment.resolve_device(config["device"])
        st.add_file(write_text(args.evidence / "config.yaml", yaml.safe_dump(config, sort_keys=True, allow_unicode=True)))
        st.write_json("env.json", environment.describe(device))
        st.params["device"] = device
        print(f"[context] {args.evidence}: device {device}, dtype {config['dtype']}", flush=True)


if __name__ == "__main__":
    main()
