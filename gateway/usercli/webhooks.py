"""``finetune webhooks``: the tenant's receivers of job events and their delivery log."""

from __future__ import annotations

import click

from gateway.usercli.client import _echo_json, _when, call


@click.group("webhooks")
def webhooks() -> None:
    """Receivers of your jobs' events (succeeded, failed, cancelled), signed the Standard Webhooks way."""


@webhooks.command("add")
@click.argument("url")
def add(url: str) -> None:
    """Register URL (tenant admins); prints its signing secret, which is shown only now."""
    r = call("POST", "/v1/webhooks", json={"url": url}).json()
    click.echo(f"{r['id']}  {r['url']}\n  secret (shown once; verify with it): {r['secret']}")


@webhooks.command("list")
@click.option("--json", "as_json", is_flag=True)
def list_endpoints(as_json: bool) -> None:
    """Your endpoints."""
    page = call("GET", "/v1/webhooks").json()
    rows = page["data"]
    if as_json:
        _echo_json(page)   # the API's list object (object, data, has_more): one shape for every list
        return
    for r in rows:
        click.echo(f"{r['id']}  {r['url']}")
    if not rows:
        click.echo("no webhook endpoints: finetune webhooks add https://...")


@webhooks.command("rm")
@click.argument("webhook_id")
def remove(webhook_id: str) -> None:
    """Delete an endpoint (tenant admins)."""
    call("DELETE", f"/v1/webhooks/{webhook_id}")
    click.echo(f"{webhook_id} deleted")


@webhooks.command("deliveries")
@click.argument("webhook_id")
@click.option("--json", "as_json", is_flag=True)
def deliveries(webhook_id: str, as_json: bool) -> None:
    """An endpoint's delivery log, newest first."""
    page = call("GET", f"/v1/webhooks/{webhook_id}/deliveries").json()
    rows = page["data"]
    if as_json:
        _echo_json(page)   # the API's list object (object, data, has_more): one shape for every list
        return
    for d in rows:
        click.echo(f"{d['id']}  {d['type']:<28} {d['job_id']}  {d['status']:<9} {d['attempts']} attempt(s)  "
                   f"last {d['last_status'] or d['last_error'] or '-'}  delivered {_when(d['delivered_at'])}")
