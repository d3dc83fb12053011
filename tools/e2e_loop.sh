#!/usr/bin/env bash
# The end-to-end tests alone (each a real `vllm serve`), run N times in a row on this checkout,
# to show they do not flake. Each run's pytest summary goes on one line; a failing run keeps
# its log. Exit status: 0 when every run passed.
#
#   tools/e2e_loop.sh [-n RUNS] [-- PYTEST_ARGS...]      (default 10 runs of tests/e2e)
set -uo pipefail

runs=10
while getopts "n:" opt; do
  case "$opt" in
    n) runs=$OPTARG ;;
    *) echo "usage: $0 [-n RUNS] [-- PYTEST_ARGS...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "$#" -gt 0 ] || set -- tests/e2e

repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
cd "$repo" || exit 2
[ -x .venv/bin/python ] || { echo "no .venv here: run make deps first" >&2; exit 2; }
logs=$(mktemp -d "${TMPDIR:-/tmp}/ascend-guard-e2e.XXXXXX")
commit=$(git rev-parse --short=10 HEAD)
passed=0
for i in $(seq 1 "$runs"); do
  log="$logs/run-$i.log"
  start=$(date +%s)
  .venv/bin/python -m pytest -q -rs -p no:cacheprovider "$@" > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)" "$log" | tail -1)
  printf 'run %d/%d: commit %s, exit %d, %dm%02ds, %s\n' "$i" "$runs" "$commit" "$rc" \
    $((secs / 60)) $((secs % 60)) "${summary:-no pytest summary}"
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    rm -f "$log"
  else
    grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/    /'
    echo "    log: $log"
  fi
done
echo "e2e loop: $passed of $runs runs passed"
[ "$passed" -eq "$runs" ]
