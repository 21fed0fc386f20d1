"""Publication of a completed attempt: the transaction that makes a job succeeded.

Owns the sequence ``gateway.services.publish`` describes: the broker builds and verifies the
results as the tenant (``publish_build``), the eval gate and ``check_results`` judge
what came back, the result ``DataFile`` rows and the PUBLISHED transition are recorded,
``publish_commit`` renames the build dir into ``artifacts/<id>/`` and the session
commits; on any failure it rolls back and removes what was built. Imports the models,
``gateway.services.publish``, ``services.jobspec``/``jobcreate``/``jobwrites`` and storage's verbs
and layout; the reconciler calls
``publish_attempt`` for a job in PUBLISHING.

A job that ended without publishing has its checkpoints published by ``services.checkpointpub``.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlmodel import Session

from gateway.config import Settings
from gateway.errors import Conflict, ServiceError
from gateway.models import DataFile, FineTuningJob, new_id, utcnow
from gateway.services import jobcreate, jobspec, publish
from gateway.services.checkpointpub import add_result_rows, checkpoint_steps, log_skipped
from gateway.services.jobwrites import apply_event
from gateway.state import Cleanup, Event, FailReason
from gateway.storage import Storage, layout
from trainer.contract.spec import Hyperparameters, spec_data, spec_hash

log = logging.getLogger(__name__)


def fine_tuned_model_name(job: FineTuningJob, tenant: str) -> str:
    """The name a published job's model is known by: ``ft:<base>:<tenant>:<suffix>:<job id>``, or
    ``ft:<base>:<tenant>:<job id>`` for a job without a suffix (no empty ``::`` field: issue 35;
    models published before keep the names they were given)."""
    return ":".join(["ft", job.model, tenant, *([job.suffix] if job.suffix else []), job.id])


def build_lineage(*, session: Session, settings: Settings, job: FineTuningJob, tenant: str,
                  built: dict[str, Any], results: dict[str, tuple[int, str]]) -> dict[str, Any]:
    """The registry record of ``job``'s model, at publication.

    From the gateway's own records: base model and digest, the datasets' ids and sha256s, the
    resolved hyperparameters and seed, the spec the trainer was given and its hash, the Slurm
    job, account, QOS, attempts and layout, the parent model, the results' and checkpoints'
    sha256s (computed by the broker from the files it built). ``trainer`` holds what the
    trainer reported in its manifest (library versions, steps, training seconds; it runs as
    the tenant, so it is the tenant's word), and ``spec_verified`` says whether the spec hash
    it reported is the gateway's: then the
    hyperparameters here are the ones it trained with.
    """
    train = session.get(DataFile, job.training_file)
    val = session.get(DataFile, job.validation_file) if job.validation_file else None
    init = session.get(DataFile, job.init_file) if job.init_file else None
    hp = {k: v for k, v in (job.hyperparameters or {}).items() if k not in jobspec.NOT_TRAINER_HYPERPARAMETERS}
    resolved = Hyperparameters.model_validate(hp).model_dump(mode="json")
    ours: str | None = None
    spec: dict[str, Any] | None = None
    try:
        entry = jobcreate.catalog_entry(settings, job.model)
        if train is not None:
            typed = jobspec.job_spec(settings, tenant, job, train, val, entry, init)
            spec, ours = spec_data(typed), spec_hash(typed)
    except ServiceError:
        ours = None   # the base left the catalog: the record says it could not check
    raw_manifest, raw_eval = built.get("manifest"), built.get("evaluation")
    reported: dict[str, Any] = raw_manifest if isinstance(raw_manifest, dict) else {}
    evaluation: dict[str, Any] = raw_eval if isinstance(raw_eval, dict) else {}

    def loss(when: str, key: str = "loss") -> float | None:
        part = evaluation.get(when)
        value = part.get(key) if isinstance(part, dict) else None
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    seconds = reported.get("train_seconds")
    return {
        "base_model": {"name": job.model, "digest": job.model_digest},
        "parent": job.parent_model,
        "method": job.method,
        "training_file": {"id": job.training_file, "sha256": train.sha256 if train else None},
        "validation_file": {"id": val.id, "sha256": val.sha256} if val else None,
        "hyperparameters": resolved, "seed": resolved["seed"],
        "spec_hash": ours, "spec_verified": ours is not None and reported.get("spec_hash") == ours,
        "spec": spec,     # what the trainer was given (its hash is spec_hash): the reproducibility bundle's core
        "trainer": reported,
        "slurm": {"job_id": job.slurm_job_id, "account": tenant, "qos": job.qos, "attempts": job.attempt + 1,
                  "gpus": job.gpus, "nodes": job.nodes, "fsdp": job.fsdp,
                  "training_gpu_seconds": round(seconds * job.gpus, 1) if isinstance(seconds, float) else None},
        "eval": {"before": loss("before"), "after": loss("after"),
                 "best_step": evaluation.get("best_step") if isinstance(evaluation.get("best_step"), int) else None,
                 **({f"{key}_{when}": loss(when, key) for key in ("reward_accuracy", "reward_margin")
                     for when in ("before", "after")} if job.method == "dpo" else {})},
        "results": {name: f"sha256:{sha}" for name, (_, sha) in results.items() if layout.is_main_result(name)},
        "checkpoints": sorted(({"step": step, "sha256": f"sha256:{sha}"} for name, (_, sha) in results.items()
                               if (step := layout.checkpoint_step_of(name)) is not None), key=lambda c: c["step"]),
        "published_at": utcnow().isoformat(timespec="seconds"),
    }


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
        built = store.publish_build(job.id, job.attempt, job.model_digest, checkpoint_steps(session, job))
        evaluation = built.get("evaluation")
        refused = publish.eval_gate(evaluation if isinstance(evaluation, dict) else {},
                                    settings.eval_gate, settings.eval_gate_tolerance)
        if refused:
            store.remove([(layout.ARTIFACTS, built["name"])])
            raise publish.PublishError(refused)
        results = publish.check_results(built.get("results"), built.get("checkpoints") or [])
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
        rows = add_result_rows(session, job, aid, results)
        session.flush()
        log_skipped(job, built.get("skipped_checkpoints"))
        try:
            lineage = build_lineage(session=session, settings=settings, job=job, tenant=tenant_name,
                                    built=built, results=results)
        except Exception:  # noqa: BLE001 - a record that cannot be built never blocks the publication
            log.exception("job %s: no lineage record", job.id)
            lineage = None
        apply_event(session, job, Event.PUBLISHED, message="The job has successfully completed",
                    fine_tuned_model=fine_tuned_model_name(job, tenant_name), lineage=lineage,
                    result_files=[r.id for r in rows if layout.is_main_result(r.filename[len(job.id) + 1:])],
                    finished_at=utcnow(), cleanup=Cleanup.PENDING)
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

