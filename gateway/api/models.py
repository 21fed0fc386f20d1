"""/v1/models: the base-model catalog and the tenant's fine-tuned models."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter

from gateway.access.policy import Policy
from gateway.api.deps import PrincipalDep, SessionDep, SettingsDep, access
from gateway.errors import NotFound
from gateway.models import FineTuningJob
from gateway.services import jobmodels

router = APIRouter(prefix="/v1/models", tags=["models"])


def _catalog(settings: Any) -> list[dict[str, Any]]:
    from trainer import catalog  # lazy: the trainer side (catalog), read per request

    out = []
    for e in catalog.list_models(settings.models_root):
        created = int(datetime.fromisoformat(e.added_at).timestamp()) if e.added_at else 0
        out.append({"id": e.name, "object": "model", "created": created, "owned_by": "system",
                    "digest": e.digest, "capabilities": {"tool_calling": e.tool_calling}})
    return out


def _ft_model(job: FineTuningJob, tenant: str, lineage: bool = False) -> dict[str, Any]:
    created = int(job.finished_at.timestamp()) if job.finished_at else 0
    out: dict[str, Any] = {"id": job.fine_tuned_model, "object": "model", "created": created, "owned_by": tenant,
                           "root": job.model, "parent": job.parent_model, "job_id": job.id}
    if lineage:   # the registry record (gateway.services.publication.build_lineage); None before it existed
        out["lineage"] = job.lineage
    return out


@router.get("", dependencies=[access(Policy.AUTHENTICATED)])
def list_models(session: SessionDep, settings: SettingsDep, principal: PrincipalDep) -> dict[str, Any]:
    """List the base models and, for a tenant token, the tenant's own fine-tuned models."""
    data = _catalog(settings)
    if principal.tenant_name:       # tenant tokens: their own fine-tuned models too
        data += [_ft_model(j, principal.tenant_name)
                 for j in jobmodels.fine_tuned_models(session=session, principal=principal)]
    return {"object": "list", "data": data}


@router.get("/{model_id:path}", dependencies=[access(Policy.AUTHENTICATED)])
def retrieve_model(model_id: str, session: SessionDep, settings: SettingsDep,
                   principal: PrincipalDep) -> dict[str, Any]:
    """One model of ``GET /v1/models`` by id (a base model or one of the tenant's, with its
    ``lineage``); 404 otherwise, a foreign tenant's model included."""
    if principal.tenant_name and jobmodels.CHECKPOINT_MODEL.fullmatch(model_id):
        job, step, adapter = jobmodels.find_checkpoint_model(session=session, principal=principal, model_id=model_id)
        return {"id": model_id, "object": "model", "created": int(adapter.created_at.timestamp()),
                "owned_by": principal.tenant_name, "root": job.model, "parent": job.fine_tuned_model,
                "job_id": job.id, "step": step, "lineage": jobmodels.checkpoint_lineage(job, step, adapter)}
    if principal.tenant_name and model_id.startswith("ft:"):
        for j in jobmodels.fine_tuned_models(session=session, principal=principal):
            if j.fine_tuned_model == model_id:
                return _ft_model(j, principal.tenant_name, lineage=True)
    else:
        for m in _catalog(settings):
            if m["id"] == model_id:
                return m
    raise NotFound(f"no such model: {model_id}", param="model")


@router.delete("/{model_id:path}", dependencies=[access(Policy.TENANT)])
def delete_model(model_id: str, session: SessionDep, settings: SettingsDep,
                 principal: PrincipalDep) -> dict[str, Any]:
    """Delete a fine-tuned model: its adapter, checkpoints and staging leave storage."""
    jobmodels.delete_fine_tuned_model(session=session, settings=settings, principal=principal, model_id=model_id)
    return {"id": model_id, "object": "model", "deleted": True}
