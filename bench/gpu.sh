#!/usr/bin/env bash
# The GPU checks in one run, within 8 minutes on a machine with an NVIDIA GPU (bench/README.md):
# bitsandbytes NF4 on CUDA, the FSDP-QLoRA smoke, ours vs TRL-best tokens/s / peak CUDA memory / MFU
# on a ~1B Llama shape and an 8B-shaped slice (TRL on our attention kernel, tokens counted from the
# data, MFU from model FLOPs: bench/gpu.py training_flops), the GPU wipe's canary test with a
# negative control. One JSON line last.
#
#   bench/gpu.sh [--dry] [bench/gpu.py options]      SFT_GPU_DRY=1 is the same as --dry
#
# --dry runs on CPU in seconds (tiny shapes; what needs CUDA is reported as "not_run").
# SFT_PY picks the interpreter (default: the runtime venv, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${SFT_PY:-/opt/slurm-finetune/venv/bin/python}"
[ -x "$PY" ] || PY=python3
args=("$@")
if [ "${SFT_GPU_DRY:-0}" = 1 ]; then
    args+=(--dry)
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# 480 s = 8 minutes: bench/gpu.py starts no part after --budget-s (450 s) and prints its JSON line
exec timeout --kill-after=15 "${SFT_GPU_TIMEOUT_S:-480}" "$PY" bench/gpu.py "${args[@]}"
