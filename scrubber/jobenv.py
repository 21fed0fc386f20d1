"""The job as slurmd describes it to the prolog/epilog: the only place that reads the environment."""

from __future__ import annotations

import os
import pwd
import socket
from collections.abc import Mapping
from dataclasses import dataclass


class JobEnvError(ValueError):
    """slurmd did not give the variables a prolog/epilog needs; the message names them."""


@dataclass(frozen=True)
class JobContext:
    job_id: int
    uid: int
    gid: int
    user: str
    node: str
    gpus: tuple[int, ...]  # SLURM_JOB_GPUS: indices into this node's GPU list (gres.conf)


def parse_gpu_list(text: str) -> tuple[int, ...]:
    """``"0,2"`` → ``(0, 2)``; ``""``/unset → ``()``. Raises ValueError on anything else."""
    text = text.strip()
    if not text or text.lower() in ("none", "(null)"):
        return ()
    return tuple(sorted({int(p) for p in text.split(",")}))


def job_context(env: Mapping[str, str] | None = None) -> JobContext:
    """Read SLURM_JOB_ID/UID/USER/GPUS and SLURMD_NODENAME. Raises JobEnvError."""
    env = os.environ if env is None else env
    missing = [k for k in ("SLURM_JOB_ID", "SLURM_JOB_UID") if not env.get(k)]
    if missing:
        raise JobEnvError(f"not run by slurmd: {', '.join(missing)} unset "
                          "(the prolog/epilog needs SLURM_JOB_ID and SLURM_JOB_UID)")
    try:
        uid = int(env["SLURM_JOB_UID"])
        job_id = int(env["SLURM_JOB_ID"])
        gpus = parse_gpu_list(env.get("SLURM_JOB_GPUS", ""))
    except ValueError as e:
        raise JobEnvError(f"bad SLURM_* value: {e}") from e
    try:
        pw = pwd.getpwuid(uid)
        user, gid = pw.pw_name, pw.pw_gid
    except KeyError:
        user, gid = env.get("SLURM_JOB_USER", str(uid)), int(env.get("SLURM_JOB_GID", uid) or uid)
    node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    return JobContext(job_id=job_id, uid=uid, gid=gid, user=user, node=node, gpus=gpus)
