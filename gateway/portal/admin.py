"""Admin pages (sysadmin tokens only): usage and fairness, nodes and scrubs, tenants and QOS tiers."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response

from gateway.access import Policy
from gateway.api.deps import SettingsDep
from gateway.portal.session import PortalUser
from gateway.portal.web import PortalRoute, UserDep, portal_access, render
from gateway.services import Forbidden, ServiceError
from gateway.slurm.runner import SlurmError

router = APIRouter(prefix="/portal/admin", route_class=PortalRoute, include_in_schema=False,
                   dependencies=[portal_access(Policy.SYSADMIN)])


def get_admin(user: UserDep) -> PortalUser:
    if not user.is_admin:
        raise Forbidden("The admin pages need a sysadmin token; yours belongs to "
                        f"{user.label}. Sign in with a sysadmin token to see them.")
    return user


AdminDep = Annotated[PortalUser, Depends(get_admin)]


def _slurm(request: Request) -> Any:
    client = request.app.state.slurm
    if client is None:
        raise ServiceError("Slurm does not answer from this gateway: the cluster pages are unavailable.",
                           code="no_backend")
    if client.runner is None:      # local mode's scheduler: no cluster, accounts or usage to show
        raise ServiceError("This gateway runs in local mode: there is no Slurm cluster to report on.",
                           code="no_backend")
    return client


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
def overview(request: Request, settings: SettingsDep, user: AdminDep) -> Response:
    """Drained or down nodes with Slurm's reason, and the latest scrub reports per node."""
    from gateway.scrub import latest_reports

    client, error = request.app.state.slurm, None
    nodes = []
    if client is None:
        error = "Slurm does not answer from this gateway."
    else:
        try:
            nodes = client.drained_nodes()
        except SlurmError as e:
            error = f"sinfo failed: {e}"
    scrubs = latest_reports(settings.scrub_report_dir, per_node=5)
    return render(request, "admin.html", user=user, nodes=nodes, scrubs=scrubs, error=error)


@router.get("/usage")
def usage(request: Request, settings: SettingsDep, user: AdminDep,
          start: str = Query("-7d", max_length=40), end: str = Query("now", max_length=40),
          by: str = Query("tenant", max_length=10)) -> Response:
    """The usage report (sacct) with its charts, and the fairshare report (sshare)."""
    from accounting.charts import gpu_hours_png, wait_png
    from accounting.fairshare import fairshare_report
    from accounting.gateway_facts import load_gateway_facts
    from accounting.usage import GROUPINGS, usage_report
    from accounting.window import DATE_HELP, AccountingError, make_window

    ctx: dict[str, Any] = {"start": start, "end": end, "by": by, "groupings": GROUPINGS, "date_help": DATE_HELP}
    try:
        if by not in GROUPINGS:
            raise AccountingError(f"group by {by!r} is not a grouping; valid: {', '.join(GROUPINGS)}")
        window = make_window(start, end)
        client = _slurm(request)
        rows = client.sacct(window.start, window.end)
        now = datetime.now(UTC)
        facts = load_gateway_facts(settings.database_url, window)
        rep = usage_report(rows, window, by=by, now=now, facts=facts)
        by_tenant = rep if by == "tenant" else usage_report(rows, window, by="tenant", now=now, facts=facts)
        fs = fairshare_report(client.sshare(), by_tenant, parent=settings.parent_account)
    except (AccountingError, SlurmError) as e:
        return render(request, "admin_usage.html", user=user, error=str(e), status=400, **ctx)
    ctx.update(report=rep, fairshare=fs, bars=share_bars(fs), gpu_chart=_png(gpu_hours_png(by_tenant)),
               wait_chart=_png(wait_png(rep)))
    return render(request, "admin_usage.html", user=user, error=None, **ctx)


@router.get("/tenants")
def tenants(request: Request, settings: SettingsDep, user: AdminDep) -> Response:
    """Tenants (Slurm accounts under the parent account) and the QOS tiers on the cluster."""
    from gateway.slurm.admin import Admin

    admin = Admin(_slurm(request).runner, storage_root=settings.storage_root,
                  parent_account=settings.parent_account)
    try:
        rows, qos = admin.list_tenants(), admin.show_qos()
    except SlurmError as e:
        return render(request, "admin_tenants.html", user=user, error=f"sacctmgr failed: {e}",
                      tenants=[], qos=[], status=502)
    return render(request, "admin_tenants.html", user=user, error=None, tenants=rows, qos=qos)
