"""Model pages: a fine-tuned model's lineage (what it was made from) and the tenant's aliases."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from gateway.access.policy import Policy
from gateway.api.deps import SessionDep
from gateway.errors import NotFound
from gateway.portal.web import PortalRoute, UserDep, portal_access, render
from gateway.services import jobmodels, registry

router = APIRouter(prefix="/portal/models", route_class=PortalRoute, include_in_schema=False,
                   dependencies=[portal_access(Policy.TENANT)])


_PARTS = ("base_model", "training_file", "eval", "slurm", "hyperparameters", "results", "trainer")


def _view(lineage: dict[str, Any] | None) -> dict[str, Any]:
    """The record with every section present (a record from an older release may lack some)."""
    if not lineage:
        return {}
    return {**lineage, **{k: lineage.get(k) or {} for k in _PARTS}}


@router.get("")
def list_models(request: Request, session: SessionDep, user: UserDep) -> Response:
    """The tenant's fine-tuned models and aliases."""
    models = jobmodels.fine_tuned_models(session=session, principal=user.principal)
    return render(request, "models.html", user=user, models=models,
                  aliases=registry.aliases(session=session, principal=user.principal))


@router.get("/{model_id:path}")
def show_model(model_id: str, request: Request, session: SessionDep, user: UserDep) -> Response:
    """One of the tenant's models: its lineage record; another tenant's answers 404."""
    for job in jobmodels.fine_tuned_models(session=session, principal=user.principal):
        if job.fine_tuned_model == model_id:
            held = [a for a in registry.aliases(session=session, principal=user.principal)
                    if a.fine_tuned_model == model_id]
            return render(request, "model.html", user=user, job=job, lin=_view(job.lineage), aliases=held)
    raise NotFound("no such model among yours", param="model")
