"""Stage `context`: the recorded campaign config and the environment, first files of a directory."""

from __future__ import annotations

import json

import yaml

from evident.workflow.core import layout
from evident.workflow.core.evidence import Stage, stage_args, write_text
from evident.workflow.plan import environment


def main(argv: list[str] | None = None) -> None:
    ap = stage_args(__doc__)
    ap.add_argument("--config-json", required=True, help="the recorded campaign config as JSON")
    args = ap.parse_args(argv)
    config = json.loads(args.config_json)
    with Stage(args.evidence, "context", params={"campaign": config["campaign"], "dtype": config["dtype"]}) as st:
        device = environment.resolve_device(config["device"])
        recorded = yaml.safe_dump(config, sort_keys=True, allow_unicode=True)
        st.add_file(write_text(args.evidence / layout.CONFIG, recorded))
        st.write_json(layout.ENV, environment.describe(device))
        st.params["device"] = device
        print(f"[context] {args.evidence}: device {device}, dtype {config['dtype']}", flush=True)


if __name__ == "__main__":
    main()
