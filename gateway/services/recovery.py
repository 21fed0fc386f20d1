"""Submitting again a job whose submission was interrupted (the gateway died between its
commit and sbatch): the spec comes from the gateway's own record, never from tenant storage.

Imports the models, the job services and storage; used by the reconciler's recovery step.
"""

from __future__ import annotations

import logging

from sqlmodel import Session

from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.models import DataFile, FineTuningJob, Tenant
from gateway.services import jobcreate, jobspec
from gateway.storage import Storage
from trainer.contract.spec import JobSpec

log = logging.getLogger(__name__)


def resubmittable_spec(*, session: Session, settings: Settings, storage: Storage, job: FineTuningJob,
                       tenant: Tenant) -> JobSpec | None:
    """The spec to submit again, rebuilt from the job's row; None if the job can no longer run
    (a file deleted, the base model gone or changed). A spec.json left in tenant storage is
    untrusted (the tenant can rewrite it): it is parsed, validated and compared, and a mismatch
    is logged, never used."""
    spec = _rebuilt_spec(session, settings, job, tenant)
    if spec is not None:
        try:
            saved = storage.tenant(tenant.name).read_spec(job.id)
        except ServiceError:
            saved = None
        if saved is not None and not jobspec.saved_spec_matches(saved, spec):
            log.warning("job %s: the spec.json in tenant storage differs from the gateway's "
                        "record; submitting the recorded spec", job.id)
    return spec


def _rebuilt_spec(session: Session, settings: Settings, job: FineTuningJob, tenant: Tenant) -> JobSpec | None:
    train = session.get(DataFile, job.training_file)
    val = session.get(DataFile, job.validation_file) if job.validation_file else None
    init = session.get(DataFile, job.init_file) if job.init_file else None
    if train is None or train.deleted_at is not None or (val is not None and val.deleted_at is not None):
        return None
    if job.init_file and (init is None or init.deleted_at is not None):
        return None
    try:
        entry = jobcreate._catalog_entry(settings, job.model)   # looked up at call time (tests patch it)
        if job.model_digest and entry.digest != job.model_digest:
            return None
        return jobspec.job_spec(settings, tenant.name, job, train, val, entry, init)
    except ServiceError:
        return None
