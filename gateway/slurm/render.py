"""Render the sbatch script for a job: a pure function over plain data.

Values that reach ``#SBATCH`` lines are checked against a strict character set
(sbatch parses those lines itself, not a shell); values that reach the shell
body are quoted with ``shlex.quote``. The directives come in the fixed order of
``slurm_templates/finetune.sbatch``, so a golden-file test pins the output.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from string import Template

from gateway.errors import SlurmError
from trainer.contract import exitcodes

_DIRECTIVE_SAFE = re.compile(r"^[A-Za-z0-9._/@:+=,-]+$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


class RenderError(SlurmError, ValueError):
    """A value cannot be placed in an sbatch script safely."""


def warning_s(grace_s: int, minutes: int) -> int:
    """How long before the time limit the trainer is told to checkpoint and stop (Slurm's
    ``--signal=B:USR1@<s>``, local mode's submitit ``signal_delay_s``): the site's grace, but at most
    a quarter of the limit, so that a short limit (``--time 1``) warns the job near its end, not as it
    starts (Slurm) or never (submitit waits ``limit - delay`` seconds: a negative wait never comes)."""
    return max(1, min(grace_s, minutes * 60 // 4))


@dataclass(frozen=True)
class JobScript:
    """Everything the sbatch script needs; paths are absolute."""

    job_name: str
    account: str
    qos: str
    job_dir: str
    command: tuple[str, ...]
    gpus: int = 1                # per node; one task (trainer rank) per GPU
    nodes: int = 1
    cpus: int = 1
    mem_mb: int = 4096
    time_limit_min: int = 60
    grace_s: int = 90
    # after the gateway's cancel (USR2), the seconds the script gives the trainer before it kills it
    # itself and records the job CANCELLED (below the gateway's own deadline: see finetune.sbatch)
    cancel_grace_s: int = 15
    partition: str | None = None
    requeue: bool = True
    env: dict[str, str] = field(default_factory=dict)


def format_time_limit(minutes: int) -> str:
    """Minutes → Slurm's ``D-HH:MM:00`` (``90`` → ``0-01:30:00``)."""
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def _directive(name: str, value: str) -> str:
    if not isinstance(value, str) or not _DIRECTIVE_SAFE.fullmatch(value):
        raise RenderError(
            f"{name} {value!r} contains characters not allowed in an sbatch directive "
            "(allowed: letters, digits and ._/@:+=,-)"
        )
    return value


def _positive(name: str, value: int, maximum: int) -> str:
    if not isinstance(value, int) or not 0 < value <= maximum:
        raise RenderError(f"{name} must be an integer in 1..{maximum}, got {value!r}")
    return str(value)


GANG_RETRIES = 3
"""How many times a gang that lost a rank is requeued before the job fails."""

_NOT_RETRIED = (exitcodes.OK, exitcodes.INTERNAL, exitcodes.USER_ERROR, exitcodes.GPU_UNAVAILABLE,
                exitcodes.MODEL_ERROR)
"""Exit statuses a gang is never requeued for: success, a plain internal error, the trainer's refusals."""

GANG_PORT_BASE = 20000
"""A gang's rendezvous port: ``GANG_PORT_BASE + job id % 20000`` on its first node."""


def _gang(job: JobScript) -> dict[str, str]:
    """The lines that differ for a gang (several ranks): one srun step, one task per GPU.

    The ranks find each other at ``MASTER_ADDR:MASTER_PORT`` (the first node of the
    allocation, a port from the job id); each reads its rank from ``SLURM_PROCID``.
    srun forwards the batch script's USR1/TERM to every rank, and ``--kill-on-bad-exit``
    ends the whole step when one rank dies (gang semantics: the job fails or requeues
    as one): a lost rank requeues the job up to ``GANG_RETRIES`` times, and the next
    attempt resumes from the newest complete checkpoint. A single rank runs as a plain
    child, exactly as before.
    """
    nodes = int(_positive("nodes", job.nodes, 1024))
    per_node = int(_positive("gpus", job.gpus, 64))
    if nodes == 1 and per_node == 1:
        return {"tasks_lines": "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n", "gang_lines": "", "launch": "",
                "gang_requeue": ""}
    return {
        "tasks_lines": f"#SBATCH --nodes={nodes}\n#SBATCH --ntasks-per-node={per_node}\n",
        "gang_lines": (
            "# a gang: the ranks meet on the first node (at its NodeAddr: a node name need not resolve);\n"
            "# each reads its rank from SLURM_PROCID\n"
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
            'MASTER_ADDR=$(scontrol show node "$head_node" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\' | head -n 1)\n'
            'MASTER_ADDR=${MASTER_ADDR:-$head_node}\n'
            f"MASTER_PORT=$(( {GANG_PORT_BASE} + SLURM_JOB_ID % 20000 ))\n"
            "export MASTER_ADDR MASTER_PORT\n"
        ),
        "launch": (f"srun --kill-on-bad-exit=1 --nodes={nodes} --ntasks-per-node={per_node} "
                   f"--cpus-per-task={_positive('cpus', job.cpus, 1024)} --export=ALL "),
        # a lost rank shows as the trainer's PEER_LOST, a rank's signal death (128 + KILL), or
        # CANCELLED when srun's --kill-on-bad-exit TERMs the survivors; a TERM Slurm sent (time
        # limit, an administrator) reached this script too (termed=1) and is not retried. Requeued:
        # a gang that failed for anything but the trainer's refusals (_NOT_RETRIED) or such a TERM,
        # a bounded number of times
        "gang_requeue": (' || { ' + ''.join(f'[ "$rc" -ne {code} ] && ' for code in _NOT_RETRIED)
                         + f'{{ [ "$rc" -ne {exitcodes.CANCELLED} ] || [ "$termed" = 0 ]; }} '
                         f'&& [ "${{SLURM_RESTART_COUNT:-0}}" -lt {GANG_RETRIES} ]; }}'),
    }


def render_sbatch(job: JobScript) -> str:
    """Return the batch script text for ``job``; raise RenderError on an unsafe value."""
    if not job.command:
        raise RenderError("command must not be empty")
    if not job.job_dir.startswith("/"):
        raise RenderError(f"job_dir must be absolute, got {job.job_dir!r}")
    for key in job.env:
        if not _ENV_NAME.fullmatch(key):
            raise RenderError(f"environment variable name {key!r} is not allowed")
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(job.env.items()))
    values = {
        "job_name": _directive("job_name", job.job_name),
        "account": _directive("account", job.account),
        "qos": _directive("qos", job.qos),
        "partition_line": (
            f"#SBATCH --partition={_directive('partition', job.partition)}\n"
            if job.partition else ""
        ),
        "gpus": _positive("gpus", job.gpus, 64),
        "cpus": _positive("cpus", job.cpus, 1024),
        "mem_mb": _positive("mem_mb", job.mem_mb, 16 * 1024 * 1024),
        "time_limit": format_time_limit(int(_positive("time_limit_min", job.time_limit_min,
                                                       365 * 24 * 60))),
        "grace_s": _positive("grace_s", job.grace_s, 3600),
        "cancel_grace_s": _positive("cancel_grace_s", job.cancel_grace_s, 3600),
        "requeue_line": "#SBATCH --requeue\n" if job.requeue else "#SBATCH --no-requeue\n",
        "requeue_exit": str(exitcodes.REQUEUE),
        "job_dir": _directive("job_dir", job.job_dir),
        "exports": exports,
        "command": shlex.join(job.command),
        **_gang(job),
    }
    text = resources.files("slurm_templates").joinpath("finetune.sbatch").read_text()
    return Template(text).substitute(values)


MAX_ARRAY_TASKS = 64


def render_array(jobs: Sequence[JobScript], *, name: str) -> str:
    """One batch script that runs ``jobs`` as the tasks of a job array, held (``--hold``).

    Task ``i`` runs ``jobs[i]``'s own script (``render_sbatch``: its directory, environment and
    command; its signal, cancel and requeue handling). The directives are shared: the jobs must
    agree on account, QOS, partition and resources, the time limit is the longest of them, and
    their directories must be siblings. A task's output goes to ``<its dir>/slurm-<id>.out``, as
    a single job's does: the task opens it itself (Slurm expands ``%x`` in ``--output`` with the
    array's name, so no directive can name the task's directory).
    """
    if not 1 <= len(jobs) <= MAX_ARRAY_TASKS:
        raise RenderError(f"an array has 1 to {MAX_ARRAY_TASKS} tasks, not {len(jobs)}")
    first = jobs[0]
    shared = ("account", "qos", "partition", "gpus", "nodes", "cpus", "mem_mb", "grace_s", "cancel_grace_s",
              "requeue")
    parent = posixpath.dirname(first.job_dir)
    for job in jobs[1:]:
        differ = [k for k in shared if getattr(job, k) != getattr(first, k)]
        if differ:
            raise RenderError(f"the tasks of an array must agree on {', '.join(differ)}")
        if posixpath.dirname(job.job_dir) != parent:
            raise RenderError("the tasks of an array must have sibling job directories")
    for job in jobs:
        if posixpath.basename(job.job_dir) != job.job_name:
            raise RenderError(f"job {job.job_name}: its directory must be named after it (output goes to %x)")
    bodies = [render_sbatch(job) for job in jobs]          # each one checked
    header = render_sbatch(replace(first, job_name=name, job_dir=parent,
                                   time_limit_min=max(j.time_limit_min for j in jobs)))
    header = header[:header.index("# Rendered by slurm-finetune")]
    output = f"#SBATCH --output={parent}/slurm-%j.out\n"
    if output not in header:
        raise RenderError("unexpected batch script header")
    header = header.replace(output, "#SBATCH --output=/dev/null\n"
                            f"#SBATCH --array=0-{len(jobs) - 1}\n#SBATCH --hold\n")
    cases = "".join(f"    {i}) cd {shlex.quote(job.job_dir)} && exec >>\"slurm-$SLURM_JOB_ID.out\" 2>&1 "
                    f"&& exec /bin/bash -c {shlex.quote(body)} ;;\n"
                    for i, (job, body) in enumerate(zip(jobs, bodies, strict=True)))
    return (f"{header}# Rendered by slurm-finetune (gateway.slurm.render_array); do not edit by hand.\n"
            "# Each task runs its own job's script (the same one a single job gets).\n"
            "umask 077\n"
            'case "${SLURM_ARRAY_TASK_ID:-}" in\n'
            f"{cases}"
            '    *) echo "slurm-finetune: no task ${SLURM_ARRAY_TASK_ID:-?} in this array" >&2; exit 1 ;;\n'
            "esac\n")
