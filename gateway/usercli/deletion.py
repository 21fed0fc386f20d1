"""``finetune deletion``: a tenant admin asks for the tenant and all its data to be deleted.

The request only asks; the sysadmin carries it out (``finetune admin tenant delete NAME``), after
which ``status`` reads ``done`` with the deletion receipt's sha256 (the receipt itself is the
sysadmin's to hand over).
"""

from __future__ import annotations

from typing import Any

import click

from gateway.usercli.client import _echo_json, _when, call

PATH = "/v1/tenant/deletion_request"


def _show(r: dict[str, Any]) -> None:
    if r["status"] == "none":
        click.echo("no deletion request for this tenant")
        return
    click.echo(f"{r['id']}  {r['status']}  asked by {r['requested_by']} at {_when(r['requested_at'])}"
               + (f"  reason: {r['reason']}" if r["reason"] else ""))
    if r["status"] == "pending":
        click.echo("  the sysadmin carries it out (`finetune admin tenant delete`); withdraw it with "
                   "`finetune deletion withdraw`")
    elif r["decided_at"]:
        click.echo(f"  {r['status']} by {r['decided_by']} at {_when(r['decided_at'])}"
                   + (f"; receipt sha256 {r['receipt_sha256']}" if r["receipt_sha256"] else ""))


@click.group("deletion")
def deletion() -> None:
    """Ask for your tenant and all its data to be deleted (tenant admins); the sysadmin carries it out."""


@deletion.command("request")
@click.option("--reason", default="", help="Why (at most 500 characters; the sysadmin and the audit log see it).")
@click.option("--json", "as_json", is_flag=True)
def request(reason: str, as_json: bool) -> None:
    """Ask for the deletion (a pending request is shown as it is)."""
    r = call("POST", PATH, json={"reason": reason}).json()
    _echo_json(r) if as_json else _show(r)


@deletion.command("status")
@click.option("--json", "as_json", is_flag=True)
def status(as_json: bool) -> None:
    """Your tenant's newest deletion request and where it stands."""
    r = call("GET", PATH).json()
    _echo_json(r) if as_json else _show(r)


@deletion.command("withdraw")
@click.option("--json", "as_json", is_flag=True)
def withdraw(as_json: bool) -> None:
    """Withdraw your tenant's pending deletion request."""
    r = call("DELETE", PATH).json()
    _echo_json(r) if as_json else _show(r)
