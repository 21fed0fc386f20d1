"""Queued jobs' expected starts, kept as Slurm plans them (``squeue --start``), for the job object
and the portal: ONE call per refresh, only while some job is pending, at most every
``START_REFRESH_S``; a start is written only when it moved by a minute or more, so a steady plan
costs no writes. A failed query changes nothing.
"""

from __future__ import annotations

import logging
import time

from sqlmodel import Session

from gateway.errors import SlurmError
from gateway.models import FineTuningJob
from gateway.services.jobwrites import StaleJob, update_fields
from gateway.slurm.client import JobStatus
from gateway.slurm.scheduler import Scheduler
from gateway.state import JobState, SlurmState

log = logging.getLogger(__name__)
START_REFRESH_S = 30.0     # how often queued jobs' expected starts are read again


class ExpectedStarts:
    """``refresh`` once per cycle; it asks Slurm at most every START_REFRESH_S."""

    def __init__(self, client: Scheduler):
        self.client = client
        self._next = 0.0

    def refresh(self, s: Session, jobs: list[FineTuningJob], states: dict[int, JobStatus]) -> None:
        """Keep each queued job's expected start as Slurm plans it (``squeue --start``: ONE call, only when
        some job is pending, at most every START_REFRESH_S); written only when it moved by a minute or more."""
        pending = [j for j in jobs if j.status == JobState.QUEUED.value and j.slurm_job_id
                   and states.get(j.slurm_job_id) is not None and states[j.slurm_job_id].state == SlurmState.PENDING]
        if not pending or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + START_REFRESH_S
        try:
            starts = self.client.pending_starts([j.slurm_job_id for j in pending if j.slurm_job_id])
        except SlurmError as e:
            log.info("expected starts unreadable: %s", e)
            return
        for job in pending:
            new = starts.get(job.slurm_job_id) if job.slurm_job_id else None
            old = job.expected_start
            if new is not None and (old is None or abs((new - old).total_seconds()) >= 60):
                try:
                    update_fields(s, job, expected_start=new)
                    s.commit()
                except StaleJob:
                    s.rollback()
