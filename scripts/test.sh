#!/usr/bin/env bash
# The test command (README; .ci/run calls it). As root on Debian 12 it sets up
# everything (bootstrap + dev cluster) and runs every test tier the machine can run;
# tiers it cannot run are skipped and listed, with the reason, at the end, with each
# tier's time and the 25 slowest tests.
#
#   scripts/test.sh --fast   the edit loop (a few minutes at most): ruff, mypy and the unit tier
#                            (the contract and architecture tests are unit tests); no bootstrap,
#                            no dev cluster, no broker
#
# Every other argument goes to pytest (`scripts/test.sh --fast -k lines`, `scripts/test.sh tests/slurm`).
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX="${SFT_RUNTIME_PREFIX:-/opt/slurm-finetune}"
PY="$PREFIX/venv/bin/python"

fast=0
args=()
for arg in "$@"; do
    if [ "$arg" = --fast ]; then fast=1; else args+=("$arg"); fi
done

if [ "$fast" = 1 ]; then
    [ -x "$PY" ] || { echo "test: no runtime at $PREFIX/venv: run scripts/test.sh once (as root) or scripts/bootstrap.sh" >&2; exit 1; }
elif [ "$(id -u)" = 0 ]; then
    bash scripts/bootstrap.sh
    bash scripts/test-mlflow.sh      # the MLflow server the slurm tier's integration test logs to
else
    echo "test: not root: skipping bootstrap; the slurm and ssh tiers will be skipped" >&2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONDONTWRITEBYTECODE=1

echo "== ruff"
"$PY" -m ruff check gateway trainer scrubber accounting tests bench
echo "== mypy"
"$PY" -m mypy
if [ "$fast" = 0 ] && [ "$(id -u)" = 0 ]; then
    echo "== dev cluster"
    "$PREFIX/venv/bin/finetune" dev-cluster up
    # the broker an earlier run started may hold older code: stop that one (its recorded pid,
    # checked to be this instance's broker), never another instance's or another user's
    "$PY" -m gateway.storage.launch --stop
fi
if [ "$fast" = 1 ]; then
    # the unit tier: tests marked unit, or unmarked (tests/conftest.py marks those unit), and no other tier
    echo "== pytest (unit tier)"
    select=(--durations=10 -m "not (train or slurm or ssh or service or browser or hostile or local or gpu or slow)")
else
    echo "== pytest (all tiers)"
    # -m "slow or not slow": also the slow tests (the real SmolLM2 import), which a plain run skips
    select=(--durations=25 -m "slow or not slow")
fi
set +e
"$PY" -m pytest -p no:cacheprovider "${select[@]}" "${args[@]}"
rc=$?
set -e
[ "$rc" = 5 ] && { echo "test: pytest collected no tests" >&2; exit 1; }
exit "$rc"
