#!/usr/bin/env bash
# The test suite's GPU branches on a lent GPU machine (CI has no GPU, so they run only here): each test file that
# takes one, with the wheels of .whl/ (tools/device_wheels.sh) on the path, within a time budget; a file the budget
# does not reach is named "not run". A failing file's whole output goes to $OUT (the device tool's folder that comes
# back; /tmp elsewhere) as <file>.log. Exit 1 if any file failed.
#   usage: tools/device_tests.sh [seconds] [test files...]   (the default list: the files with a CUDA branch,
#   tests/test_route_kernel.py last: it alone takes about 3 minutes on an H200)
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${1:-540}
shift $(( $# < 1 ? $# : 1 ))
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  mapfile -t files < <(grep -l "cuda.is_available" tests/test_*.py | grep -v test_route_kernel.py)
  files+=(tests/test_route_kernel.py)
fi
. tools/device_site.sh install
end=$((SECONDS + budget)) failed=0
for f in "${files[@]}"; do
  left=$((end - SECONDS))
  if [ "$left" -lt 20 ]; then echo "not run: $f"; continue; fi
  out=$(timeout "$left" python3 -m pytest -q -p no:warnings -rfE "$f" 2>&1)
  rc=$?
  if [ "$rc" -eq 124 ]; then echo "$f: stopped at the budget (${left} s left for it)"; else echo "$f: $(echo "$out" | tail -1)"; fi
  echo "$out" | grep -E "^(FAILED|ERROR) " || true
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then  # 5: every test deselected or none collected
    failed=1 log="${OUT:-/tmp}/$(basename "$f" .py).log"
    echo "$out" > "$log" && echo "  its output: $log"
  fi
done
exit "$failed"
