"""Watching a running job: the detectors' rules (``jobs.detectors``, pure) run over what the
gateway knows of it, each new finding raised once per attempt as a warning event and counted for
/metrics, and the one action a rule may ask for carried out: requeue a stalled job, which resumes
from its newest checkpoint. The reconciler calls ``watch_running`` for a job Slurm runs and the
gateway thinks running, once per cycle.
"""

from __future__ import annotations

import logging
import time

from sqlmodel import Session

from gateway.config import Settings
from gateway.errors import SlurmError
from gateway.jobs import detectors
from gateway.models import FineTuningJob
from gateway.services.jobwrites import add_event, update_fields
from gateway.slurm.client import JobStatus
from gateway.slurm.records import Owner
from gateway.slurm.render import warning_s
from gateway.slurm.scheduler import Scheduler

log = logging.getLogger(__name__)


def watch_running(s: Session, job: FineTuningJob, st: JobStatus, *, settings: Settings, limits: detectors.Limits,
                  counts: dict[str, int], client: Scheduler, owner: Owner) -> None:
    """Run the detectors on a running job: each new finding once per attempt as a warning event
    (and a count in ``counts``, for /metrics); a stall past its grace requeues the job in Slurm."""
    progress = dict(job.progress or {})
    start = st.queue.start if st.queue is not None else None
    time_left = ((start.timestamp() + (job.time_limit_min or 60) * 60) - time.time()) if start else None
    every = int((job.hyperparameters or {}).get("checkpoint_every_steps") or settings.checkpoint_every_steps)
    warned = warning_s(settings.signal_grace_s, job.time_limit_min or 60)    # when the job is told to stop
    findings = detectors.check(progress, attempt=job.attempt, now=time.time(), checkpoint_every=every,
                               time_left_s=time_left, grace_s=warned,
                               limits=limits, running_since=start.timestamp() if start else None)
    fired = dict(progress.get("fired") or {})
    new = [f for f in findings if fired.get(f.rule) != job.attempt]
    if not new:
        return
    for f in new:
        fired[f.rule] = job.attempt
        counts[f.rule] = counts.get(f.rule, 0) + 1
        add_event(s, job.id, f"Detector {f.rule}: {f.message}", level="warn",
                  data={"detector": f.rule, "attempt": job.attempt})
        log.warning("job %s: detector %s fired (attempt %d)", job.id, f.rule, job.attempt)
    update_fields(s, job, progress={**progress, "fired": fired})
    if any(f.requeue for f in new) and job.slurm_job_id is not None:
        try:
            client.requeue(job.slurm_job_id, owner=owner)
        except SlurmError as e:
            log.warning("job %s: requeue after a stall failed: %s", job.id, e)
