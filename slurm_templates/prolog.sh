#!/bin/bash
# slurm-finetune prolog (rendered by `finetune dev-cluster up`): runs as root on the node
# before the job. Non-zero exit drains the node and requeues the job.
# The work is in the scrubber package of the runtime venv (never the checkout):
# scratch dir 0700 for the job user, no leftover tenant process, GPUs clean.
# Settings: /etc/slurm-finetune/scrubber.toml (optional); report: ${report_dir}/<node>/<job>-prolog.json
exec ${runtime_prefix}/venv/bin/python -I -m scrubber prolog --scratch-root ${scratch_root} --report-dir ${report_dir} --log-dir ${log_dir}
