#!/bin/bash
# slurm-finetune epilog (rendered by `finetune dev-cluster up`): runs as root on the node
# after the job (also after cancel, timeout, OOM). Non-zero exit drains the node.
# The work is in the scrubber package of the runtime venv (never the checkout): kill the
# job user's leftovers, wipe the job's GPUs, remove scratch and the user's /tmp, /dev/shm files.
# Settings: /etc/slurm-finetune/scrubber.toml (optional); report: ${report_dir}/<node>/<job>-epilog.json
exec ${runtime_prefix}/venv/bin/python -I -m scrubber epilog --scratch-root ${scratch_root} --report-dir ${report_dir} --log-dir ${log_dir}
