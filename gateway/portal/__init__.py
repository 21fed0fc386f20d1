"""The web portal: server-rendered pages for tenants (datasets, jobs) and sysadmins (cluster).

Pages call the same service functions as the API with the principal of the
session's token, so the API's tenant scoping applies unchanged.
"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.portal import access, admin, auth, datasets, jobs, models, oidc, sweeps
from gateway.portal.web import STATIC_DIR, STATIC_URL

router = APIRouter()
for _sub in (auth.router, oidc.router, datasets.router, jobs.router, models.router, sweeps.router, access.router,
             admin.router):
    router.include_router(_sub)

__all__ = ["STATIC_DIR", "STATIC_URL", "router"]
