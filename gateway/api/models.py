"""/v1/models: the base-model catalog and the tenant's fine-tuned models."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from sqlmodel import col, select

from gateway.access import Policy
from gateway.api.deps import PrincipalDep, SessionDep, SettingsDep, access
from gateway.models import FineTuningJob
from gateway.services import NotFound, ServiceError
from gateway.services import jobs as jobs_svc
from gateway.services.jobs import _tenant_id

router = APIRouter(prefix="/v1/models", tags=["models"])


def _catalog(settings: Any) -> list[dict[str, Any]]:
    from trainer import catalog

    out = []
    for e in catalog.list_models(settings.models_root):
        created = int(datetime.fromisoformat(e.added_at).timestamp()) if e.added_at else 0
        out.append({"id": e.name, "object": "model", "created": created, "owned_by": "system",
                    "digest": e.digest})
    return out


def _ft_models(session: Any, tenant_id: int, tenant: str) -> list[dict[str, Any]]:
    rows = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tenant_id,
                                                    col(FineTuningJob.fine_tuned_model).is_not(None)))
    return [{"id": j.fine_tuned_model, "object": "model", "created": int(j.finished_at.timestamp())
             if j.finished_at else 0, "owned_by": tenant, "root": j.model, "job_id": j.id} for j in rows]


@router.get("", dependencies=[access(Policy.AUTHENTICATED)])
def list_models(session: SessionDep, settings: SettingsDep, principal: PrincipalDep) -> dict[str, Any]:
    data = _catalog(settings)
    if principal.tenant_id is not None and principal.tenant_name:
        data += _ft_models(session, principal.tenant_id, principal.tenant_name)
    return {"object": "list", "data": data}


@router.get("/{model_id:path}", dependencies=[access(Policy.AUTHENTICATED)])
def retrieve_model(model_id: str, session: SessionDep, settings: SettingsDep,
                   principal: PrincipalDep) -> dict[str, Any]:
    for m in list_models(session, settings, principal)["data"]:
        if m["id"] == model_id:
            return m
    raise NotFound(f"no such model: {model_id}", param="model")


@router.delete("/{model_id:path}", dependencies=[access(Policy.TENANT)])
def delete_model(model_id: str, session: SessionDep, settings: SettingsDep,
                 principal: PrincipalDep) -> dict[str, Any]:
    """Delete a fine-tuned model: its adapter, checkpoints and staging leave storage."""
    tid = _tenant_id(principal)
    job = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tid,
                                                   FineTuningJob.fine_tuned_model == model_id)).first()
    if job is None:
        if any(m["id"] == model_id for m in _catalog(settings)):
            raise ServiceError("base models are managed by the administrators", code="forbidden")
        raise NotFound(f"no such model: {model_id}", param="model")
    jobs_svc.delete_model(session=session, settings=settings, principal=principal, job=job)
    return {"id": model_id, "object": "model", "deleted": True}
