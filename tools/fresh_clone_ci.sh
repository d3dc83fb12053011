#!/usr/bin/env bash
# CI as a new user gets it: clone the repository (a committed revision, not the work tree) into
# a fresh temporary directory, run .ci/run there, and print how long it took. Repeat with -n.
#
#   tools/fresh_clone_ci.sh [-n RUNS] [-r REVISION] [-k]     (-k keeps the clones)
#
# Each run starts from nothing: no .venv, no .cache, no Prometheus download kept from an
# earlier run (make test sets them all up). Exit status: 0 when every run passed.
set -uo pipefail

runs=1
rev=HEAD
keep=0
while getopts "n:r:k" opt; do
  case "$opt" in
    n) runs=$OPTARG ;;
    r) rev=$OPTARG ;;
    k) keep=1 ;;
    *) echo "usage: $0 [-n RUNS] [-r REVISION] [-k]" >&2; exit 2 ;;
  esac
done

repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
commit=$(git -C "$repo" rev-parse --verify "$rev^{commit}") || exit 2
passed=0
for i in $(seq 1 "$runs"); do
  dir=$(mktemp -d "${TMPDIR:-/tmp}/ascend-guard-ci.XXXXXX")
  git clone --quiet --no-local "$repo" "$dir/repo" && git -C "$dir/repo" checkout --quiet "$commit" || exit 2
  start=$(date +%s)
  (cd "$dir/repo" && ./.ci/run) > "$dir/ci.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)" "$dir/ci.log" | tail -1)
  printf 'run %d/%d: commit %s, exit %d, %dm%02ds, %s (log: %s)\n' "$i" "$runs" "${commit:0:10}" \
    "$rc" $((secs / 60)) $((secs % 60)) "${summary:-no pytest summary}" "$dir/ci.log"
  [ "$rc" -eq 0 ] && passed=$((passed + 1))
  if [ "$keep" -eq 0 ] && [ "$rc" -eq 0 ]; then rm -rf "$dir/repo"; fi
done
echo "fresh-clone CI: $passed of $runs runs passed"
[ "$passed" -eq "$runs" ]
