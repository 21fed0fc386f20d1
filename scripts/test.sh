#!/usr/bin/env bash
# The test command (README; .ci/run calls it). As root on Debian 12 it sets up
# everything (bootstrap + dev cluster) and runs every test tier the machine can run;
# tiers it cannot run are skipped and listed, with the reason, at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX="${SFT_RUNTIME_PREFIX:-/opt/slurm-finetune}"
PY="$PREFIX/venv/bin/python"

if [ "$(id -u)" = 0 ]; then
    bash scripts/bootstrap.sh
else
    echo "test: not root: skipping bootstrap; the slurm and ssh tiers will be skipped" >&2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONDONTWRITEBYTECODE=1

echo "== ruff"
"$PY" -m ruff check gateway trainer scrubber accounting tests bench
echo "== mypy"
"$PY" -m mypy
if [ "$(id -u)" = 0 ]; then
    echo "== dev cluster"
    "$PREFIX/venv/bin/finetune" dev-cluster up
fi
# a storage broker left by an earlier run may hold older code: the tests start a fresh one
pkill -f "gateway.storage.broker" 2>/dev/null || true
echo "== pytest (all tiers)"
set +e
# -m "slow or not slow": also the slow tests (the real SmolLM2 import), which a plain run skips
"$PY" -m pytest -p no:cacheprovider -m "slow or not slow" "$@"
rc=$?
set -e
[ "$rc" = 5 ] && { echo "test: pytest collected no tests" >&2; exit 1; }
exit "$rc"
