#!/bin/sh
# slurm-finetune TaskProlog (rendered by `finetune dev-cluster up`): runs as the job user
# before each task; "export NAME=value" lines on stdout go into the task's environment.
# SFT_SCRATCH: the job's private scratch dir (0700), made by the prolog, removed by the epilog.
echo "export SFT_SCRATCH=${scratch_root}/job-$${SLURM_JOB_ID}"
