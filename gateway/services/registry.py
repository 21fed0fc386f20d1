"""Promotion: a tenant's aliases per base model (``prod`` of tiny-chat), moved only through a gate.

The gate compares the candidate's final eval loss with the current holder's, both as their
lineage recorded them at publication, and only on the same validation file (same sha256):
a loss on other data says nothing about which model is better. The candidate may be at most
``tolerance`` worse (absolute, default 0: not worse). Every promotion, and every refusal by
the gate, is an audit entry (the refusal is committed although the request fails).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from sqlmodel import Session, select

from gateway.access import audit
from gateway.access.tokens import Principal, actor
from gateway.errors import Conflict, NotFound, ServiceError
from gateway.models import FineTuningJob, ModelAlias, utcnow
from gateway.state import JobState

ALIAS = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")


def _own_model(session: Session, tid: int, model_id: str) -> FineTuningJob:
    job = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tid,
                                                   FineTuningJob.fine_tuned_model == model_id)).first()
    if job is None or job.status != JobState.SUCCEEDED:
        raise NotFound(f"no such model: {model_id}", param="model")
    return job


def _judged(job: FineTuningJob) -> tuple[float, str]:
    """(final eval loss, validation file sha256) from the job's lineage; ServiceError if it has none."""
    lin = job.lineage or {}
    after = (lin.get("eval") or {}).get("after")
    val = lin.get("validation_file") or {}
    if not isinstance(after, int | float) or not val.get("sha256"):
        raise ServiceError(f"{job.fine_tuned_model} has no final eval on a validation file in its record "
                           "(trained with a held-out split, or published before the registry): train it with "
                           "a validation_file to promote it", param="model", code="not_gateable")
    return float(after), str(val["sha256"])


def promote(*, session: Session, principal: Principal, model_id: str, alias: str, tolerance: float = 0.0,
            now: datetime | None = None) -> tuple[ModelAlias, dict[str, Any]]:
    """Point ``alias`` (of ``model_id``'s base) at ``model_id`` if the gate lets it; commits.

    Returns the alias row and the gate's figures. Raises NotFound for a model not the tenant's
    (a foreign one included), ServiceError for a bad alias or a model without a gateable eval,
    Conflict (``promotion_refused``) when the candidate is worse than the holder, or was
    evaluated on another validation file.
    """
    if principal.tenant_id is None or principal.tenant_name is None:
        raise NotFound(f"no such model: {model_id}", param="model")
    if not ALIAS.fullmatch(alias):
        raise ServiceError("alias must be 1-40 of a-z, 0-9, _ and -, starting with a letter", param="alias")
    now = now or utcnow()
    candidate = _own_model(session, principal.tenant_id, model_id)
    loss, val = _judged(candidate)
    row = session.exec(select(ModelAlias).where(ModelAlias.tenant_id == principal.tenant_id,
                                                ModelAlias.base_model == candidate.model,
                                                ModelAlias.alias == alias)).first()
    gate: dict[str, Any] = {"candidate": model_id, "candidate_loss": loss, "validation_sha256": val,
                            "holder": row.fine_tuned_model if row else None, "holder_loss": None,
                            "tolerance": tolerance}
    by = actor(principal)
    if row is not None and row.fine_tuned_model != model_id:
        try:
            holder_loss, holder_val = _judged(_own_model(session, principal.tenant_id, row.fine_tuned_model))
        except (NotFound, ServiceError):
            holder_loss, holder_val = None, None     # the holder was deleted: nothing to beat
        gate["holder_loss"] = holder_loss
        refusal = None
        if holder_val is not None and holder_val != val:
            refusal = (f"{model_id} was evaluated on validation file sha256:{val[:12]}..., the holder of "
                       f"{alias!r} {row.fine_tuned_model} on sha256:{holder_val[:12]}...: train the candidate "
                       "with the holder's validation file to compare them")
        elif holder_loss is not None and loss > holder_loss + tolerance:
            refusal = (f"{model_id}'s eval loss {loss:.6g} is worse than {holder_loss:.6g}, that of "
                       f"{row.fine_tuned_model}, which holds {alias!r}, on the same validation file")
        if refusal:
            session.rollback()   # nothing written yet; the refusal is committed on its own
            audit.append_now(session.get_bind().engine, at=now, actor=by, action="model.promote",
                             outcome=audit.DENIED, tenant=principal.tenant_name, resource=f"model:{model_id}",
                             reason=f"alias {alias} of {candidate.model}: {refusal}")
            raise Conflict(f"promotion refused: {refusal}", code="promotion_refused")
    before = row.fine_tuned_model if row else None
    if row is None:
        row = ModelAlias(tenant_id=principal.tenant_id, base_model=candidate.model, alias=alias,
                         fine_tuned_model=model_id, promoted_at=now, promoted_by=principal.token_id)
    else:
        row.fine_tuned_model, row.promoted_at, row.promoted_by = model_id, now, principal.token_id
    session.add(row)
    audit.append(session, at=now, actor=by, action="model.promote", outcome=audit.ALLOWED,
                 tenant=principal.tenant_name, resource=f"model:{model_id}",
                 reason=f"alias {alias} of {candidate.model}: {before or '(new)'} -> {model_id}; eval loss "
                        f"{gate['holder_loss'] if gate['holder_loss'] is not None else '-'} -> {loss:.6g} on "
                        f"validation sha256:{val[:12]}...")
    session.commit()
    session.refresh(row)
    return row, gate


def aliases(*, session: Session, principal: Principal) -> list[ModelAlias]:
    """The tenant's aliases (none for a principal without a tenant), by base model and name."""
    if principal.tenant_id is None:
        return []
    return list(session.exec(select(ModelAlias).where(ModelAlias.tenant_id == principal.tenant_id)
                             .order_by(ModelAlias.base_model, ModelAlias.alias)))  # type: ignore[arg-type]
