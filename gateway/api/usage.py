"""``GET /v1/usage``: the calling tenant's storage, used against its quota (``services/storageuse.py``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway.access.policy import Policy
from gateway.api.deps import PrincipalDep, SessionDep, SettingsDep, access
from gateway.services import storageuse

router = APIRouter(tags=["usage"])


@router.get("/v1/usage", dependencies=[access(Policy.TENANT)])
def usage(principal: PrincipalDep, session: SessionDep, settings: SettingsDep) -> dict[str, Any]:
    """The tenant's storage: used and limit bytes as the filesystem counts them (``enforced_by`` names
    what enforces the limit, null where nothing does), its files by kind, its retention policy."""
    return storageuse.usage(session=session, settings=settings, principal=principal)
