#!/usr/bin/env bash
# Run a campaign on a lent GPU machine (no network, its own python3 with torch/triton/transformers).
# Snakemake and MLflow travel as wheels in .whl/ (see docs/gpu-and-cluster.md); the evidence
# directory comes back as one archive in $OUT.
#   usage: EVIDENT_GIT_COMMIT=<sha> tools/device_campaign.sh config/campaigns/X.yaml [seconds] [snakemake args...]
# (e.g. --config 'stages=[oracle,parity,bench]': the evidence records the config the run had)
set -uo pipefail
campaign=${1:?campaign file}
budget=${2:-540}
shift $(( $# < 2 ? $# : 2 ))
. "$(dirname "$0")/device_site.sh" install
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m | head -4
# greedy scheduler: the ILP one needs pulp, which is not carried (16 MB). Snakemake's log goes whole to $OUT (it comes
# back) and only its tail here, so that what a call printed before (tests run in the same call) stays within the
# device tool's output tail
timeout "$budget" python3 -m snakemake --cores all --scheduler greedy --keep-going --rerun-incomplete \
  --configfile "$campaign" "$@" 2>&1 | grep --line-buffered -vE '^\s*(input|output|log|jobid|benchmark|reason|resources|wildcards|threads):' \
  > "$OUT/snakemake.log"
rc=${PIPESTATUS[0]}
echo "== snakemake exited $rc; the last lines of its log (whole: \$OUT/snakemake.log)"
tail -n 25 "$OUT/snakemake.log"
tar czf "$OUT/evidence.tar.gz" evidence .evident/logs 2>/dev/null
# the summary carries the verdicts and short tables, DETAILS.md every full table (parity, bench, overlap); each also
# comes back as a file, SUMMARY_<campaign>_<run>.md and DETAILS_<campaign>_<run>.md in $OUT itself (the device tool
# returns files at most two folders down)
for f in evidence/*/*/SUMMARY.md evidence/*/*/DETAILS.md; do
  [ -e "$f" ] || continue
  name=${f##*/} run=${f#evidence/} run=${run%/*} && cp "$f" "$OUT/${name%.md}_${run//\//_}.md"
  echo "== $f"; cat "$f"
done
exit "$rc"
