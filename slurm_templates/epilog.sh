#!/bin/bash
# slurm-finetune epilog wrapper (rendered by `finetune dev-cluster up`).
# Runs as root on the node after the job (also after cancel, timeout, OOM).
# Non-zero exit drains the node. The scrubber package replaces this body.
set -u
scratch_root=${scratch_root}
log=${log_dir}/epilog.log
job=$${SLURM_JOB_ID:?}
dir="$$scratch_root/job-$$job"
rm -rf --one-file-system -- "$$dir"
if [ -e "$$dir" ]; then
    echo "$$(date -Is) epilog job=$$job scratch=NOT-REMOVED" >>"$$log"
    exit 1
fi
echo "$$(date -Is) epilog job=$$job user=$${SLURM_JOB_USER:-?} scratch=removed" >>"$$log"
exit 0
