"""The checkpoints of a job that ended without publishing (failed, timed out, cancelled) made
files, as a succeeded job's publication makes its own (``services.publication``): the broker packs
each complete one (``checkpoints_build``), their ``DataFile`` rows and an event are recorded,
``publish_commit`` makes them visible and the session commits. Then ``from_checkpoint`` continues the
job whatever its end (issue 35). The reconciler starts ``publish_checkpoints`` in a worker thread
(``jobs.workers``) once a job's end is committed; ``jobcreate`` calls it when a continuation names a
job whose checkpoints are not files yet (that call failed, or the job ended before this existed).
"""

from __future__ import annotations

import logging
from typing import Any

from sqlmodel import Session, col, select

from gateway.errors import Conflict, ServiceError
from gateway.models import DataFile, FineTuningJob, JobCheckpoint, new_id
from gateway.services import publish
from gateway.services.jobmodels import checkpoint_files
from gateway.services.jobwrites import add_event
from gateway.state import JobState
from gateway.storage import Storage, layout

log = logging.getLogger(__name__)


def checkpoint_steps(session: Session, job: FineTuningJob) -> list[int]:
    """The steps of ``job``'s recorded checkpoints (the newest ``MAX_CHECKPOINTS``): publication
    makes the adapter of each one still on disk a model of its own."""
    steps = session.exec(select(JobCheckpoint.step).where(JobCheckpoint.job_id == job.id).distinct()
                         .order_by(col(JobCheckpoint.step).desc()).limit(layout.MAX_CHECKPOINTS))
    return sorted(n for n in steps if 1 <= n <= layout.MAX_STEP)


def log_skipped(job: FineTuningJob, skipped: Any) -> None:
    """Log (no event: the tenant's files, not the gateway's fault) which checkpoints were not packed, and why."""
    if isinstance(skipped, dict) and skipped:
        why = "; ".join(f"step {k}: {v}" for k, v in list(skipped.items())[:8]
                        if isinstance(k, str) and isinstance(v, str))
        log.info("job %s: checkpoints not published: %s", job.id, why[:500])


def add_result_rows(session: Session, job: FineTuningJob, aid: str,
                    results: dict[str, tuple[int, str]]) -> list[DataFile]:
    """A ``DataFile`` row (added to ``session``) for each checked result of ``job`` built into
    artifact ``aid``, named ``<job id>-<result name>``; the rows, in ``results``' order."""
    rows = [DataFile(tenant_id=job.tenant_id, filename=f"{job.id}-{name}", purpose="fine-tune-results",
                     bytes=size, sha256=sha, status="processed", path=layout.result_path(aid, name), job_id=job.id)
            for name, (size, sha) in results.items()]
    session.add_all(rows)
    return rows


UNPUBLISHED_ENDS = frozenset({JobState.FAILED, JobState.CANCELLED})
"""The ends whose checkpoints ``publish_checkpoints`` makes files (a succeeded job's publication did)."""


def publish_checkpoints(*, session: Session, storage: Storage, job: FineTuningJob, tenant_name: str) -> list[int]:
    """Make the complete checkpoints of ``job``, which ended unpublished, result files of their own
    (``<job id>-checkpoint-step-<n>.tar``, as a succeeded job's): the steps it recorded and has not
    yet published. Commits ``session`` and returns the steps now published (empty: none left to
    publish, or none complete; the event says which and why). Any other error rolls back, removes
    what was built and raises: the job's end, committed before, stays as it is."""
    if job.status not in UNPUBLISHED_ENDS:
        return []
    done = checkpoint_files(session, job)
    steps = [n for n in checkpoint_steps(session, job) if n not in done]
    if not steps:
        return []
    store = storage.tenant(tenant_name)
    try:
        built = store.checkpoints_build(job.id, steps)
    except Conflict as e:
        add_event(session, job.id, f"No checkpoint of this job can be continued from: {e.message}", level="warn")
        session.commit()
        return []
    aid = new_id("art")
    committed = False
    try:
        results = publish.check_results(built.get("results"), built.get("checkpoints") or [], main=False)
        add_result_rows(session, job, aid, results)
        packed = sorted(n for name in results if (n := layout.checkpoint_step_of(name)) is not None)
        log_skipped(job, built.get("skipped_checkpoints"))
        add_event(session, job.id, f"Checkpoint{'s' if len(packed) > 1 else ''} at step "
                  f"{', '.join(map(str, packed))} can be continued from: create a job with "
                  f"from_checkpoint {job.id} (the newest) or {job.id}:<step>",
                  data={"checkpoints": packed})
        session.flush()
        store.publish_commit(built["name"], aid)
        committed = True
        session.commit()
        return packed
    except BaseException:
        session.rollback()
        try:
            store.remove([(layout.ARTIFACTS, built["name"])] + ([layout.artifact(aid)] if committed else []))
        except ServiceError:
            pass     # the reconciler's sweep removes a leftover build dir later
        raise
