"""Stage `archive`: rewrite the static HTML archive (workflow/archive/pages.py), `evidence/index.html` and a page per
evidence directory, after a directory is sealed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evident.workflow.archive import archive, pages


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=archive.ROOT / "index.html", help="the index; the archive is its folder")
    ap.add_argument("--tracking-uri", default=None, help="else MLFLOW_TRACKING_URI; only an http(s) server gets links")
    args = ap.parse_args(argv)
    if args.out.name != "index.html":
        sys.exit(f"[archive] --out must name an index.html (got {args.out})")
    written = pages.write_archive(args.out.parent, args.tracking_uri)
    print(f"[archive] {args.out}: {len(written) - 1} evidence pages", flush=True)


if __name__ == "__main__":
    main()
