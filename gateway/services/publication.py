"""Publication of a completed attempt: the transaction that makes a job succeeded.

Owns the sequence ``gateway.jobs.publish`` describes: the broker builds and verifies the
results as the tenant (``publish_build``), the eval gate and ``check_results`` judge
what came back, the result ``DataFile`` rows and the PUBLISHED transition are recorded,
``publish_commit`` renames the build dir into ``artifacts/<id>/`` and the session
commits; on any failure it rolls back and removes what was built. Imports the models,
``gateway.jobs.publish``, ``services.jobs`` and storage's verbs and layout; the reconciler calls
``publish_attempt`` for a job in PUBLISHING.
"""

from __future__ import annotations

from sqlmodel import Session

from gateway.config import Settings
from gateway.errors import Conflict, ServiceError
from gateway.jobs import publish
from gateway.jobs.state import Cleanup, Event, FailReason
from gateway.models import DataFile, FineTuningJob, new_id, utcnow
from gateway.services.jobs import apply_event
from gateway.storage import Storage, layout


def fine_tuned_model_name(job: FineTuningJob, tenant: str) -> str:
    """The name a published job's model is known by (``ft:<base>:<tenant>:<suffix>:<job id>``)."""
    return f"ft:{job.model}:{tenant}:{job.suffix or ''}:{job.id}"


def publish_attempt(*, session: Session, settings: Settings, storage: Storage, job: FineTuningJob,
                    tenant_name: str) -> None:
    """Publish ``job``'s current attempt. Returns with the job succeeded and ``session``
    committed, or, when the build or its figures are refused, with the job failed
    (``publication_refused``) and left for the caller to commit. Once the build is accepted,
    any failure (StaleJob when a cancel came first, a storage error in ``publish_commit``)
    rolls the session back, removes what was built and raises; an error of ``publish_build``
    itself (other than a refusal) raises as it is."""
    store = storage.tenant(tenant_name)
    try:
        built = store.publish_build(job.id, job.attempt, job.model_digest)
        evaluation = built.get("evaluation")
        refused = publish.eval_gate(evaluation if isinstance(evaluation, dict) else {},
                                    settings.eval_gate, settings.eval_gate_tolerance)
        if refused:
            store.remove([(layout.ARTIFACTS, built["name"])])
            raise publish.PublishError(refused)
        results = publish.check_results(built.get("results"))
    except (publish.PublishError, Conflict) as e:
        msg = e.message if isinstance(e, Conflict) else str(e)
        apply_event(session, job, Event.ERROR, level="error", message=f"Publication refused: {msg}",
                    error={"code": "publication_refused", "message": msg, "param": None,
                           "reason": FailReason.INTERNAL.value},
                    finished_at=utcnow(), cleanup=Cleanup.PENDING)
        return
    aid = new_id("art")
    committed = False
    try:
        rows = []
        for name, (size, sha) in results.items():
            row = DataFile(tenant_id=job.tenant_id, filename=f"{job.id}-{name}", purpose="fine-tune-results",
                           bytes=size, sha256=sha, status="processed", path=layout.result_path(aid, name),
                           job_id=job.id)
            session.add(row)
            rows.append(row)
        session.flush()
        apply_event(session, job, Event.PUBLISHED, message="The job has successfully completed",
                    fine_tuned_model=fine_tuned_model_name(job, tenant_name),
                    result_files=[r.id for r in rows], finished_at=utcnow(), cleanup=Cleanup.PENDING)
        store.publish_commit(built["name"], aid)
        committed = True
        session.commit()
    except BaseException:
        session.rollback()
        try:
            store.remove([(layout.ARTIFACTS, built["name"])] +
                         ([layout.artifact(aid)] if committed else []))
        except ServiceError:
            pass     # the reconciler's sweep removes a leftover build dir later
        raise
