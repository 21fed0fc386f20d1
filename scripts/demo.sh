#!/usr/bin/env bash
# The main job (README): set up this Debian 12 host as root and run the end-to-end demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec "${SFT_RUNTIME_PREFIX:-/opt/slurm-finetune}/venv/bin/finetune" demo
