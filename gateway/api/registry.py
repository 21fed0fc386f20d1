"""/v1/model_aliases: a tenant's named models per base (``prod``), moved by gated promotions."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from gateway.access.policy import Policy
from gateway.api.deps import PrincipalDep, SessionDep, access
from gateway.models import ModelAlias
from gateway.services import registry

router = APIRouter(prefix="/v1/model_aliases", tags=["models"])


class Promote(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=255)]
    alias: Annotated[str, Field(min_length=1, max_length=40)]
    tolerance: Annotated[float, Field(ge=0.0, le=10.0)] = 0.0   # how much worse (eval loss) may pass


def alias_object(row: ModelAlias) -> dict[str, Any]:
    """One alias as the API shows it."""
    return {"object": "model.alias", "alias": row.alias, "base_model": row.base_model,
            "model": row.fine_tuned_model, "promoted_at": int(row.promoted_at.timestamp())}


@router.get("", dependencies=[access(Policy.TENANT)])
def list_aliases(session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """The tenant's aliases, by base model and name."""
    return {"object": "list", "data": [alias_object(r) for r in registry.aliases(session=session,
                                                                                 principal=principal)]}


@router.post("", dependencies=[access(Policy.TENANT_ADMIN)])
def promote(body: Promote, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """Point an alias at one of the tenant's models, if its eval is not worse than the holder's (409 if it is)."""
    row, gate = registry.promote(session=session, principal=principal, model_id=body.model, alias=body.alias,
                                 tolerance=body.tolerance)
    return {**alias_object(row), "gate": gate}
