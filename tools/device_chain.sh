#!/usr/bin/env bash
# A GPU campaign, then the mutation suite on its checkpoint and oracle (tools/device_parity.py), in calls of the
# lent machine: each phase resumes where the last call stopped while the machine stays warm (it goes back after
# 30 s idle: re-issue the call at once). Everything printed is line-buffered, so a call cut short loses nothing.
#   usage: tools/device_chain.sh config/campaigns/X.yaml mutant1,mutant2 [seconds this call]
set -u
campaign=${1:?campaign file}
mutants=${2:?comma-separated mutants of tests/mutants.py}
end=$((SECONDS + ${3:-560}))
name=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['campaign'])" "$campaign")
if [ ! -f /tmp/chain.campaign.done ]; then
  tools/device_campaign.sh "$campaign" $((end - SECONDS - 15)); rc=$?
  echo "[chain] campaign rc=$rc at ${SECONDS}s"
  [ $rc -ne 124 ] && touch /tmp/chain.campaign.done
fi
if [ -f /tmp/chain.campaign.done ] && [ ! -f /tmp/chain.mutants.done ] && [ $((end - SECONDS)) -gt 120 ]; then
  . tools/device_site.sh  # the wheels device_campaign.sh installed
  ckpt=$(ls -d .evident/checkpoints/synthetic-*/ | head -1)  # a fresh machine holds the campaign's one
  mkdir -p /tmp/chain && ln -sfn "$PWD/$ckpt" /tmp/chain/ckpt
  timeout $((end - SECONDS - 10)) python3 tools/device_parity.py "$campaign" --kernels torch --batch-sizes 1 \
    --mutants "$mutants" --work /tmp/chain --oracle-from "$(ls -td evidence/"$name"/*/ | head -1)" 2>&1 \
    | grep --line-buffered -v "^\[parity" | tee "$OUT/mutants.log"; rc=${PIPESTATUS[0]}
  echo "[chain] mutants rc=$rc at ${SECONDS}s"
  [ $rc -ne 124 ] && touch /tmp/chain.mutants.done
fi
