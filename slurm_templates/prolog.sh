#!/bin/bash
# slurm-finetune prolog wrapper (rendered by `finetune dev-cluster up`).
# Runs as root on the node before the job. Non-zero exit drains the node and
# requeues the job. The scrubber package replaces this body with its checks.
set -u
scratch_root=${scratch_root}
log=${log_dir}/prolog.log
job=$${SLURM_JOB_ID:?}
uid=$${SLURM_JOB_UID:?}
dir="$$scratch_root/job-$$job"
if ! mkdir -p -m 0711 "$$scratch_root" || ! install -d -m 0700 -o "$$uid" -g "$$(id -g "$$uid")" "$$dir"; then
    echo "$$(date -Is) prolog job=$$job uid=$$uid scratch=FAILED" >>"$$log"
    exit 1
fi
echo "$$(date -Is) prolog job=$$job uid=$$uid gpus=$${SLURM_JOB_GPUS:-none} scratch=$$dir" >>"$$log"
exit 0
