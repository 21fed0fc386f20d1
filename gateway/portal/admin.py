"""Admin pages (sysadmin tokens only): usage and fairness, nodes and scrubs, tenants and QOS tiers."""

from __future__ import annotations

import base64
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response

from accounting.usage import GROUPINGS
from accounting.window import DATE_HELP, AccountingError
from gateway.access.policy import Policy
from gateway.errors import Forbidden
from gateway.portal.session import PortalUser
from gateway.portal.web import PortalRoute, UserDep, portal_access, render
from gateway.services import cluster as cluster_svc

router = APIRouter(prefix="/portal/admin", route_class=PortalRoute, include_in_schema=False,
                   dependencies=[portal_access(Policy.SYSADMIN)])


def get_admin(user: UserDep) -> PortalUser:
    """The signed-in user when it holds a sysadmin token; Forbidden otherwise."""
    if not user.is_admin:
        raise Forbidden("The admin pages need a sysadmin token; yours belongs to "
                        f"{user.label}. Sign in with a sysadmin token to see them.")
    return user


AdminDep = Annotated[PortalUser, Depends(get_admin)]


def _cluster(request: Request) -> cluster_svc.Cluster:
    """The cluster service the app was built with (``gateway.app``: the gateway's scheduler bound in)."""
    cluster: cluster_svc.Cluster = request.app.state.cluster
    return cluster


def _png(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def share_bars(fs: Any) -> list[dict[str, Any]]:
    """Per tenant: entitled vs used share in percent, and bar lengths scaled to the largest share."""
    rows = [{"tenant": r.tenant, "entitled": round(100 * (r.entitled_share or 0), 1),
             "used": round(100 * (r.usage_share or 0), 1), "ratio": r.ratio, "fairshare": r.fairshare,
             "shares": r.raw_shares, "jobs": r.jobs, "gpu_hours": r.gpu_seconds / 3600} for r in fs.rows]
    top = max([max(r["entitled"], r["used"]) for r in rows] + [0.1])
    for r in rows:
        r["entitled_w"], r["used_w"] = round(100 * r["entitled"] / top, 2), round(100 * r["used"] / top, 2)
    return rows


@router.get("")
def overview(request: Request, user: AdminDep) -> Response:
    """Drained or down nodes with Slurm's reason, and the latest scrub reports per node."""
    view = _cluster(request).overview()
    return render(request, "admin.html", user=user, nodes=view.nodes, scrubs=view.scrubs, error=view.error)


@router.get("/usage")
def usage(request: Request, user: AdminDep,
          start: str = Query("-7d", max_length=40), end: str = Query("now", max_length=40),
          by: str = Query("tenant", max_length=10)) -> Response:
    """The usage report (sacct) with its charts, and the fairshare report (sshare)."""
    from accounting.charts import gpu_hours_png, wait_png  # lazy: matplotlib, for this one page only

    ctx: dict[str, Any] = {"start": start, "end": end, "by": by, "groupings": GROUPINGS, "date_help": DATE_HELP}
    try:
        view = _cluster(request).usage_and_fairshare(start=start, end=end, by=by)
    except (AccountingError, cluster_svc.ClusterError) as e:
        return render(request, "admin_usage.html", user=user, error=str(e), status=400, **ctx)
    ctx.update(report=view.report, fairshare=view.fairshare, bars=share_bars(view.fairshare),
               gpu_chart=_png(gpu_hours_png(view.by_tenant)), wait_chart=_png(wait_png(view.report)))
    return render(request, "admin_usage.html", user=user, error=None, **ctx)


@router.get("/tenants")
def tenants(request: Request, user: AdminDep) -> Response:
    """Tenants (Slurm accounts under the parent account) and the QOS tiers on the cluster."""
    try:
        rows, qos = _cluster(request).tenants_and_qos()
    except cluster_svc.ClusterError as e:
        return render(request, "admin_tenants.html", user=user, error=f"sacctmgr failed: {e}",
                      tenants=[], qos=[], status=502)
    return render(request, "admin_tenants.html", user=user, error=None, tenants=rows, qos=qos)
