#!/usr/bin/env bash
# Fill .whl/ with what a campaign needs on the lent GPU machines (CPython 3.12, no network) beyond
# their image: Snakemake and MLflow (skinny, SQLite store) with their dependencies, about 22 MB, and
# transformers 5.24 (the image's 5.17 has no DeepSeek-V4; its dependencies are the image's), 12 MB, and
# openai with its dependencies (tests/test_serve.py's client: without it tools/device_tests.sh skips the file), 3 MB.
# Run here, where the package registries are reachable; .whl/ is git-ignored (.git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
# connection_pool (a Snakemake dependency) is published as a source archive only: build its wheel.
python3 -m pip wheel -q --no-deps connection_pool==0.0.3 -w "$tmp/local"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  --find-links "$tmp/local" -d "$tmp/all" snakemake==9.27.1 mlflow-skinny==3.17.2 'sqlalchemy>=2' 'alembic>=1.13' \
  openai==3.60.0
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp/all" transformers==5.24.0
# Leave out what the image already has (its package list, in the device tool's KINDS.md) and
# pulp (16 MB; tools/device_campaign.sh uses Snakemake's greedy scheduler instead).
have="annotated-doc anyio attrs certifi charset-normalizer click cloudpickle h11 idna jinja2 markupsafe
packaging protobuf psutil pyyaml requests tabulate typing-extensions urllib3 wrapt zipp pulp"
rm -rf .whl && mkdir .whl
for w in "$tmp"/all/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr '_.' '--' | tr 'A-Z' 'a-z')
  case " $(echo $have) " in *" $name "*) ;; *) cp "$w" .whl/ ;; esac
done
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
du -sh .whl && ls .whl | wc -l
