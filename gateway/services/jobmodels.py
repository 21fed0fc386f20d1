"""The models jobs make: a job's fine-tuned model and its published checkpoints as
models (``ft:…:ckpt-step-<n>``), their registry records, and deleting one.
"""

from __future__ import annotations

import re
from typing import Any

from sqlmodel import Session, col, select

from gateway.access.tokens import Principal
from gateway.config import Settings
from gateway.errors import NotFound, ServiceError
from gateway.models import DataFile, FineTuningJob, utcnow
from gateway.services.files import file_parts
from gateway.services.jobreads import tenant_id_of
from gateway.services.jobwrites import update_fields
from gateway.state import TERMINAL
from gateway.storage import layout, storage_for

CHECKPOINT_MODEL = re.compile(r"^(ft:.+):ckpt-step-([1-9][0-9]{0,8})$")
"""A checkpoint's model name (OpenAI's ``fine_tuned_model_checkpoint``): the job's model, ``:ckpt-step-<n>``."""


UNPUBLISHED_HEAD = re.compile(r"^ft:(.+):(ftjob-[0-9a-f]{24})$")
"""The head of a checkpoint's name for a job that has no model (it failed, timed out or was
cancelled): ``ft:<base>:<job id>``."""


def checkpoint_model_name(job: FineTuningJob, step: int) -> str:
    """The name of ``job``'s checkpoint ``step`` as a model: ``<fine-tuned model>:ckpt-step-<n>``, or
    for a job without one (it ended unpublished) ``ft:<base>:<job id>:ckpt-step-<n>``."""
    return f"{job.fine_tuned_model or f'ft:{job.model}:{job.id}'}:ckpt-step-{step}"


def checkpoint_files(session: Session, job: FineTuningJob) -> dict[int, DataFile]:
    """The adapter file of each of ``job``'s published checkpoints, by step (deleted ones left out)."""
    rows = session.exec(select(DataFile).where(DataFile.job_id == job.id, DataFile.tenant_id == job.tenant_id,
                                               col(DataFile.deleted_at).is_(None),
                                               col(DataFile.filename).startswith(f"{job.id}-checkpoint-step-")))
    return {step: f for f in rows if (step := layout.checkpoint_step_of(f.filename[len(job.id) + 1:])) is not None}


def find_checkpoint_model(*, session: Session, principal: Principal, model_id: str
                          ) -> tuple[FineTuningJob, int, DataFile]:
    """The tenant's published checkpoint ``model_id`` (``ft:…:ckpt-step-<n>``): its job, step and
    adapter file; NotFound otherwise (a foreign one included)."""
    tid = tenant_id_of(principal)
    m = CHECKPOINT_MODEL.fullmatch(model_id)
    job = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tid,
                                                   FineTuningJob.fine_tuned_model == m.group(1))).first() if m else None
    if m and job is None and (u := UNPUBLISHED_HEAD.fullmatch(m.group(1))):    # a job that ended unpublished
        job = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tid,
                                                       FineTuningJob.id == u.group(2))).first()
        if job is not None and checkpoint_model_name(job, int(m.group(2))) != model_id:
            job = None
    published = checkpoint_files(session, job).get(int(m.group(2))) if m and job is not None else None
    if job is None or published is None or job.status not in TERMINAL:
        raise NotFound(f"no such model: {model_id}", param="model")
    return job, int(m.group(2)) if m else 0, published


JOB_ONLY_LINEAGE = frozenset({"eval", "results", "checkpoints"})   # what a checkpoint's record does not inherit


def checkpoint_lineage(job: FineTuningJob, step: int, adapter: DataFile) -> dict[str, Any]:
    """The registry record of ``job``'s checkpoint ``step``: the job's record for what it was
    trained from and how, the checkpoint's own step, adapter sha256 and the eval at that step."""
    record = {k: v for k, v in (job.lineage or {}).items() if k not in JOB_ONLY_LINEAGE}
    evals = (job.progress or {}).get("evals") or []
    at = [e.get("loss") for e in evals if isinstance(e, dict) and e.get("step") == step
          and isinstance(e.get("loss"), int | float)]
    return {**record, "parent": job.fine_tuned_model,
            "checkpoint": {"step": step, "adapter_file": adapter.id, "sha256": f"sha256:{adapter.sha256}",
                           "eval_loss": at[-1] if at else None}}


def delete_model(*, session: Session, settings: Settings, principal: Principal, job: FineTuningJob) -> None:
    """Delete a fine-tuned model: its result files, checkpoints and staging leave the tenant's
    storage (removed as the tenant, by name beneath its root: a link planted there is removed
    itself, never followed), and the job no longer names a model."""
    assert principal.tenant_name is not None and job.tenant_id == principal.tenant_id
    paths: list[layout.Parts] = []
    for f in session.exec(select(DataFile).where(DataFile.job_id == job.id, col(DataFile.deleted_at).is_(None))):
        f.deleted_at = utcnow()
        session.add(f)
        if f.path:
            paths.append(file_parts(f)[:2])          # the whole artifacts/<art id>/ dir
    paths += layout.training_state(job.id)
    update_fields(session, job, fine_tuned_model=None)
    storage_for(settings).tenant(principal.tenant_name).remove(sorted(set(paths)))


def fine_tuned_models(*, session: Session, principal: Principal) -> list[FineTuningJob]:
    """The caller's jobs that name a fine-tuned model; none for a principal without a tenant."""
    if principal.tenant_id is None or not principal.tenant_name:
        return []
    return list(session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == principal.tenant_id,
                                                         col(FineTuningJob.fine_tuned_model).is_not(None))))


def delete_fine_tuned_model(*, session: Session, settings: Settings, principal: Principal, model_id: str) -> None:
    """Delete the tenant's fine-tuned model ``model_id`` (``delete_model``). Raises Forbidden for a
    principal without a tenant, ServiceError (``forbidden``) for a base model, NotFound otherwise."""
    from trainer import catalog  # lazy: the trainer side (catalog), only to tell a base model's name

    tid = tenant_id_of(principal)
    job = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tid,
                                                   FineTuningJob.fine_tuned_model == model_id)).first()
    if job is None:
        if any(e.name == model_id for e in catalog.list_models(settings.models_root)):
            raise ServiceError("base models are managed by the administrators", code="forbidden")
        raise NotFound(f"no such model: {model_id}", param="model")
    delete_model(session=session, settings=settings, principal=principal, job=job)
