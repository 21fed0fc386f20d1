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
# With no argument it runs every tier in two lanes side by side (see below; SFT_TEST_SERIAL=1 for
# one after the other).
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
if [ "$fast" = 0 ] && [ "${#args[@]}" = 0 ] && [ "${SFT_TEST_SERIAL:-0}" != 1 ]; then
    # Two lanes side by side (SFT_TEST_SERIAL=1: one after the other). The cluster lane (slurm, ssh,
    # browser, hostile: the dev cluster's jobs and users) mostly waits on Slurm and its jobs: about
    # one core of two stays idle through it. The other lane (unit, train, service, local, gpu: no
    # dev cluster, no Slurm job) runs in that core. Each lane has its own pytest temp dir; the other
    # lane's report is printed after the cluster lane's.
    other_log="$(mktemp /var/tmp/sft-test-lane-XXXXXX.log)"
    cluster=(-m "(slow or not slow) and (slurm or ssh or browser or hostile)")
    rest=(-m "(slow or not slow) and not (slurm or ssh or browser or hostile)")
    echo "== pytest: the other lane (unit, train, service, local, gpu) runs beside this one; its report follows"
    "$PY" -m pytest -p no:cacheprovider --durations=15 "${rest[@]}" --basetemp=/tmp/sft-tests-other \
        > "$other_log" 2>&1 &
    other=$!
    cluster_log="$(mktemp /var/tmp/sft-test-lane-XXXXXX.log)"
    # the hostile tier last: its stall test compares reconcile cycles with and without an attack
    # (a ratio of ~60 ms means), which the other lane's training skews; by then that lane is done
    mapfile -t paths < <(ls -d tests/*/ | grep -v '^tests/hostile/$')
    "$PY" -m pytest -p no:cacheprovider --durations=25 "${cluster[@]}" --basetemp=/tmp/sft-tests-cluster \
        "${paths[@]}" tests/hostile/ 2>&1 | tee "$cluster_log"
    rc=${PIPESTATUS[0]}
    wait "$other"
    rc_other=$?
    echo "== pytest: the other lane (unit, train, service, local, gpu)"
    cat "$other_log"
    echo "== both lanes"
    echo "cluster lane (slurm, ssh, browser, hostile): $(tail -n 1 "$cluster_log")"
    echo "other lane (unit, train, service, local, gpu): $(tail -n 1 "$other_log")"
    rm -f "$other_log" "$cluster_log"
    [ "$rc" = 5 ] && rc=0          # a lane with nothing to run (no root: no cluster lane) is no failure
    [ "$rc_other" = 5 ] && rc_other=0
    [ "$rc" = 0 ] && rc=$rc_other
    exit "$rc"
fi
"$PY" -m pytest -p no:cacheprovider "${select[@]}" "${args[@]}"
rc=$?
set -e
[ "$rc" = 5 ] && { echo "test: pytest collected no tests" >&2; exit 1; }
exit "$rc"
