"""The seam between a job's life and what runs it: ``SlurmClient`` (the cluster) and
``gateway.slurm.local.LocalScheduler`` (local mode) both satisfy ``Scheduler``; the reconciler,
the Submitter and the composition root see only this."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, Protocol

from gateway.slurm.client import CancelResult, JobStatus
from gateway.slurm.records import Owner
from gateway.slurm.render import JobScript


class Scheduler(Protocol):
    runner: Any     # the Slurm runner (sacctmgr for QOS lookups); None in local mode

    def submit(self, job: JobScript, *, user: str | None = None, group: str | None = None,
               runner: Any = None) -> int:
        """Submit the job script; returns its scheduler job id."""
        ...

    def states(self, job_ids: Iterable[int]) -> dict[int, JobStatus]:
        """Each job's current status; ``missing`` for one not visible yet, ``invalid`` for one whose
        records cannot be trusted this time. Act on one only if ``JobStatus.owner_problem`` is None."""
        ...

    def cancel(self, job_id: int, *, owner: Owner, deadline_s: float = 30.0, poll_s: float = 0.25,
               kill_wait_s: float = 60.0) -> CancelResult:
        """Stop the job (SIGTERM, SIGKILL after ``deadline_s``); returns once none of its processes is left."""
        ...

    def pause(self, job_id: int, *, owner: Owner) -> str | None:
        """Hold the job and make it checkpoint and leave its GPU; the state it was in (None: gone)."""
        ...

    def release(self, job_id: int, *, owner: Owner) -> None:
        """Release the job's hold: it queues again and resumes from its checkpoint."""
        ...

    def requeue(self, job_id: int, *, owner: Owner) -> None:
        """Stop the job's run and queue it again: the next attempt resumes from its checkpoint."""
        ...

    def find_by_name(self, wanted: Mapping[str, Owner], *, since: datetime | None = None) -> dict[str, int]:
        """Job ids by job name, each among its owner's jobs submitted since ``since``, for adopting a job
        whose submission was never recorded."""
        ...
