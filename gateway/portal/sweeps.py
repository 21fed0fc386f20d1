"""Sweep pages: a tenant's sweeps, and one sweep's runs side by side with their eval curves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from gateway.access.policy import Policy
from gateway.api.deps import SessionDep
from gateway.portal.web import PortalRoute, UserDep, portal_access, render
from gateway.services import sweeps as svc

router = APIRouter(prefix="/portal/sweeps", route_class=PortalRoute, include_in_schema=False,
                   dependencies=[portal_access(Policy.TENANT)])

WIDTH, HEIGHT, PAD = 640, 260, 36
COLOURS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f")


def curves(view: dict[str, Any]) -> dict[str, Any]:
    """The runs' eval curves (validation loss by step) as SVG polylines on shared axes."""
    points = [(s, v) for r in view["runs"] for s, v in r["eval_curve"]]
    if not points:
        return {"lines": [], "width": WIDTH, "height": HEIGHT}
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    sx = (WIDTH - 2 * PAD) / ((x1 - x0) or 1)
    sy = (HEIGHT - 2 * PAD) / ((y1 - y0) or 1)
    lines = []
    for i, r in enumerate(view["runs"]):
        xy = " ".join(f"{PAD + (s - x0) * sx:.1f},{HEIGHT - PAD - (v - y0) * sy:.1f}" for s, v in r["eval_curve"])
        lines.append({"task": r["task"], "points": xy, "colour": COLOURS[i % len(COLOURS)],
                      "label": ", ".join(f"{k}={v}" for k, v in r["hyperparameters"].items())})
    return {"lines": lines, "width": WIDTH, "height": HEIGHT, "x": (x0, x1), "y": (round(y0, 4), round(y1, 4))}


@router.get("")
def list_sweeps(request: Request, session: SessionDep, user: UserDep) -> Response:
    """The tenant's sweeps, newest first."""
    views = [svc.sweep_view(session, s) for s in svc.list_sweeps(session=session, principal=user.principal)]
    return render(request, "sweeps.html", user=user, sweeps=views)


@router.get("/{sweep_id}")
def show_sweep(sweep_id: str, request: Request, session: SessionDep, user: UserDep) -> Response:
    """One sweep: its runs, the best by validation loss, their eval curves; another tenant's answers 404."""
    view = svc.sweep_view(session, svc.get_sweep(session=session, principal=user.principal, sweep_id=sweep_id))
    return render(request, "sweep.html", user=user, sweep=view, chart=curves(view))
