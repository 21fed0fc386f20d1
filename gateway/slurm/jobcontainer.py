"""Where Slurm's job_container/tmpfs keeps each job's private ``/tmp`` on a node.

``job_container.conf`` names a ``BasePath`` (once, or per ``NodeName=...`` line); slurmd
bind-mounts ``<BasePath>/<job id>`` as the job's ``/tmp`` and removes it when the job ends. A
tenant's deletion looks there for what a job whose node failed to clean up left behind.
"""

from __future__ import annotations

from pathlib import Path

JOB_CONTAINER_CONF = Path("/etc/slurm/job_container.conf")


def base_paths(text: str) -> list[Path]:
    """The absolute ``BasePath`` values of a job_container.conf's text, in order, each once
    (comments and relative or malformed values skipped)."""
    out: list[Path] = []
    for line in text.splitlines():
        for word in line.split("#", 1)[0].split():
            key, _, value = word.partition("=")
            if key.lower() == "basepath" and value.startswith("/") and Path(value) not in out:
                out.append(Path(value))
    return out


def read_base_paths(path: Path = JOB_CONTAINER_CONF) -> list[Path]:
    """``base_paths`` of the file at ``path``; [] when it does not exist or cannot be read."""
    try:
        return base_paths(path.read_text())
    except OSError:
        return []


def job_tmp_dir(base: Path, slurm_job_id: int) -> Path:
    """A job's private ``/tmp`` under ``base``: ``<BasePath>/<job id>``; ValueError for a bad id."""
    if isinstance(slurm_job_id, bool) or not isinstance(slurm_job_id, int) or slurm_job_id < 1:
        raise ValueError(f"not a Slurm job id: {slurm_job_id!r}")
    return base / str(slurm_job_id)
