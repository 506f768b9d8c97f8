#!/usr/bin/env bash
# The `make run` acceptance: `make setup && make run` from fresh clones, once per seed, one after the other.
#
#   scripts/demo_runs.sh [SEED ...]        (default seeds: 1 2 3 4 5)
#
# Each run clones this repository's HEAD into a new directory under $RUNS_DIR (default /tmp/miles-demo-runs),
# runs `make setup && make run DEMO_ARGS="--seed <seed>"` there with nothing shared but the package caches, and
# keeps the log. The final `demo ...` line, the exit status and the wall time of every run are appended to
# bench/results/demo_runs.jsonl of this checkout. Exit status 0 only when every run passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
RUNS_DIR=${RUNS_DIR:-/tmp/miles-demo-runs}
SEEDS=("$@")
[[ ${#SEEDS[@]} -gt 0 ]] || SEEDS=(1 2 3 4 5)
mkdir -p "$RUNS_DIR" bench/results
commit=$(git rev-parse --short HEAD)
failed=0
for seed in "${SEEDS[@]}"; do
  clone="$RUNS_DIR/seed-$seed"
  rm -rf "$clone"
  git clone -q "$REPO" "$clone"
  started=$(date +%s)
  (cd "$clone" && make setup && make run DEMO_ARGS="--seed $seed") > "$RUNS_DIR/seed-$seed.log" 2>&1
  status=$?
  wall_s=$(( $(date +%s) - started ))
  line=$(grep -a '^demo ' "$RUNS_DIR/seed-$seed.log" | tail -1)
  echo "seed $seed: exit $status in ${wall_s}s: $line"
  python3 -c 'import json, sys; print(json.dumps({"commit": sys.argv[1], "seed": int(sys.argv[2]), "exit": int(sys.argv[3]), "wall_s_setup_and_run": int(sys.argv[4]), "line": sys.argv[5]}))' \
    "$commit" "$seed" "$status" "$wall_s" "$line" >> bench/results/demo_runs.jsonl
  [[ $status -eq 0 ]] || failed=1
done
exit $failed
