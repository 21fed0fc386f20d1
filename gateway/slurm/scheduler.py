"""The seam between a job's life and what runs it: ``SlurmClient`` (the cluster) and
``gateway.slurm.local.LocalScheduler`` (local mode) both satisfy ``Scheduler``; the reconciler,
the Submitter, the cluster pages and the composition root see only this, so no code outside
``gateway/slurm/`` asks which one it has (or builds a Slurm command line)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from gateway.slurm.client import CancelResult, JobStatus
from gateway.slurm.records import AcctRecord, DrainedNode, Owner, ShareRecord
from gateway.slurm.render import JobScript


class Scheduler(Protocol):
    runner: Any     # the Slurm runner (sacctmgr for QOS lookups); None in local mode

    # ------------------------------------------------------------------ jobs
    def submit(self, job: JobScript, *, user: str | None = None, group: str | None = None,
               runner: Any = None) -> int:
        """Submit the job script; returns its scheduler job id."""
        ...

    def submit_named_array(self, jobs: Sequence[JobScript], *, name: str, task_names: Sequence[str],
                           user: str | None = None, runner: Any = None) -> tuple[int, list[int]]:
        """Submit ``jobs`` as one job array named ``name``, task ``i`` named ``task_names[i]``, then
        released: (array id, each task's job id); nothing of it left running on failure. Local mode
        has no arrays: ServiceError (``no_backend``)."""
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

    def cancel_unnamed_tasks(self, arrays: Mapping[str, Owner]) -> list[tuple[str, int, int]]:
        """Cancel the never-named (held, never run) tasks of the arrays named as ``arrays``' keys, each
        its owner's: (array name, task, array id) of each. Local mode: none."""
        ...

    # ------------------------------------------------------------------ plans
    def pending_starts(self, job_ids: Iterable[int]) -> dict[int, datetime | None]:
        """The scheduler's expected start of each pending job among ``job_ids`` (None: not planned yet)."""
        ...

    def test_only(self, job: JobScript, *, runner: Any = None) -> tuple[datetime | None, str | None]:
        """When the scheduler would start ``job`` now (nothing submitted), and on which nodes."""
        ...

    def running_gpus(self, account: str) -> list[tuple[int, str, int, datetime | None]]:
        """The account's running jobs as (job id, QOS, GPUs, expected end)."""
        ...

    # --------------------------------------------------------------- cluster
    def drained_nodes(self) -> Sequence[DrainedNode]:
        """Nodes that are down, drained or failing, with the reason (local mode: none)."""
        ...

    def sshare(self) -> Sequence[ShareRecord]:
        """Fairshare rows for every account and user (local mode: none)."""
        ...

    def sacct(self, start: datetime, end: datetime, *, accounts: Sequence[str] | None = None
              ) -> Sequence[AcctRecord]:
        """All job runs overlapping [start, end) (local mode: none)."""
        ...
