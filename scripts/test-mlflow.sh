#!/usr/bin/env bash
# The test tiers' MLflow tracking server (tests/mlflow_server.py): MLflow in a venv of its own under
# $SFT_RUNTIME_PREFIX (default /opt/slurm-finetune/mlflow-venv), never in the product's venv (the gateway
# talks to MLflow over its REST API; mlflow pins many packages). Idempotent: a venv that already has
# this version is left as it is. scripts/test.sh runs it as root; about a minute the first time.
set -euo pipefail
PREFIX="${SFT_RUNTIME_PREFIX:-/opt/slurm-finetune}"
VENV="$PREFIX/mlflow-venv"
# 3.18.0's own mlflow-tracing==3.18.0 is not on PyPI (yet): 3.17.2 is the newest that installs
MLFLOW_VERSION="${SFT_TEST_MLFLOW_VERSION:-3.17.2}"

if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("mlflow"))' 2>/dev/null)" = "$MLFLOW_VERSION" ]; then
    exit 0
fi
echo "test-mlflow: installing mlflow==$MLFLOW_VERSION into $VENV (its own venv; about a minute once)"
[ -x "$VENV/bin/python" ] || /usr/bin/python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "mlflow==$MLFLOW_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c 'import mlflow' || { echo "test-mlflow: mlflow did not install: the MLflow tests will skip" >&2; exit 0; }
chmod -R a+rX "$VENV"
