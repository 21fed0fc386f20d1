"""``finetune admin tenant delete`` and ``delete-requests``: deleting a tenant with a receipt (root).

Each command parses its options, calls ``gateway.services.tenantdelete`` (the plan, the deletion) or
``gateway.services.deletionrequests`` (the requests tenant admins made), and prints. The database
layer is imported by the commands only, so ``finetune`` starts without it. ``gateway.cli`` mounts
both under ``admin tenant``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from gateway.cli.sysadmin import _admin
from gateway.config import get_settings
from gateway.errors import friendly_errors
from gateway.slurm.validate import validate_tenant_name


def _kinds(kinds: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{k} {v['files']}" for k, v in kinds.items()) or "nothing"


def _plan_lines(summary: dict[str, Any]) -> list[str]:
    db, st = summary["database"], summary["storage"]
    user, slurm = summary["unix_user"], summary["slurm"]
    lines = [f"  database: {db['rows']} rows ({', '.join(f'{t} {n}' for t, n in db['tables'].items()) or 'none'})",
             f"  storage {st['root']}: {st['files']} files, {st['bytes']} bytes ({_kinds(st['kinds'])})"]
    for p in summary["node_leftovers"]:
        lines.append(f"  outside it: {p['path']} ({p['files']} files, {p['bytes']} bytes)")
    lines.append(f"  Slurm account: {slurm['account'] or '(none)'}")
    lines.append(f"  unix user {user['name']}" + (f" (uid {user['uid']})" if user["uid"] is not None else "")
                 + (": removed, its ids retired" if user["removed"] else f": {user['note'] or 'kept'}"))
    if summary["requests"]:
        lines.append(f"  pending deletion requests (marked done): {', '.join(summary['requests'])}")
    return lines


@click.command("delete")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask for the tenant's name as confirmation.")
@click.option("--dry-run", is_flag=True, help="List what would go and what stands in the way; change nothing.")
@click.option("--receipt", "receipt", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the deletion receipt here (default: SFT_RECEIPT_DIR/<tenant>-<time>.json).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan (dry run) or the receipt as JSON.")
@friendly_errors
def tenant_delete(name: str, yes: bool, dry_run: bool, receipt: Path | None, as_json: bool) -> None:
    """Delete tenant NAME and all its data, with a receipt (root).

    Refused while the tenant has a job that is not final, Slurm holds a job under its account, or its
    unix user runs a process. Removes its database rows (tokens included: they stop working), its
    storage (erased as root, never following a link), what its jobs left on this host outside it, its
    Slurm account, and its unix user when slurm-finetune made it. Writes a receipt (0600) of what went
    (per kind: files, bytes, sha256), records its sha256 in the audit log and in the tenant's
    deletion requests, then erases the freed database pages. NAME can be onboarded again afterwards:
    the new tenant sees none of the old one's data.
    """
    from gateway.access.audit import open_database  # lazy: the DB layer, this command only
    from gateway.access.tokens import local_admin  # lazy: the DB layer, this command only
    from gateway.services import tenantdelete  # lazy: the DB layer, this command only

    validate_tenant_name(name)
    if os.geteuid() != 0 and not dry_run:
        raise click.ClickException("deleting a tenant needs root (its files, unix user and Slurm account): "
                                   "run it with sudo, or add --dry-run to see what would go")
    settings, adm = get_settings(), _admin()
    engine = open_database(settings)
    try:
        plan = tenantdelete.plan_deletion(engine=engine, admin=adm, settings=settings, name=name)
        summary = tenantdelete.plan_summary(plan)
        if dry_run:
            if as_json:
                click.echo(json.dumps(summary, indent=2))
                return
            click.echo(f"tenant {name}: would delete (dry run, nothing changed)")
            for line in _plan_lines(summary):
                click.echo(line)
            for why in plan.refusals:
                click.echo(f"  refused now: {why}")
            return
        if plan.refusals:
            raise click.ClickException(f"tenant {name} cannot be deleted now: " + "; ".join(plan.refusals))
        if not plan.nothing_left and not yes:
            click.echo(f"tenant {name}: this deletes, with no way back:", err=True)
            for line in _plan_lines(summary):
                click.echo(line, err=True)
            typed = click.prompt(f"type the tenant's name ({name}) to delete it", default="", show_default=False,
                                 err=True)
            if typed != name:
                raise click.ClickException("not confirmed: nothing was deleted")
        done = tenantdelete.delete_tenant(engine=engine, admin=adm, settings=settings, name=name,
                                          by=local_admin().label, receipt=receipt)
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps({"receipt": done.receipt, "path": str(done.path) if done.path else None,
                               "sha256": done.sha256, "database_scrub": done.scrub}))
        return
    if done.receipt is None:
        click.echo(f"tenant {name}: nothing of it is left to delete; database: {done.scrub}")
        return
    r = done.receipt
    click.echo(f"tenant {name} deleted: storage {r['storage']['files']} files, {r['storage']['bytes']} bytes "
               f"({_kinds(r['storage']['kinds'])}); outside it {r['node_leftovers']['files']} files; "
               f"{r['database']['rows']} database rows; Slurm account "
               f"{'removed' if r['slurm']['removed'] else 'absent'}; unix user {r['unix_user']['name']} "
               f"{'removed' if r['unix_user']['removed'] else 'left as it is'}")
    click.echo(f"receipt: {done.path} (sha256 {done.sha256}, also in the audit log)")
    click.echo(f"database: {done.scrub}")


@click.command("delete-requests")
@click.option("--json", "as_json", is_flag=True)
@friendly_errors
def tenant_delete_requests(as_json: bool) -> None:
    """Pending requests of tenant admins to delete their tenant (carry one out: `admin tenant delete NAME`)."""
    from gateway.access.audit import open_database  # lazy: the DB layer, this command only
    from gateway.db import session_scope  # lazy: the DB layer, this command only
    from gateway.services.deletionrequests import pending_requests, request_object  # lazy: the DB layer

    engine = open_database(get_settings())
    try:
        with session_scope(engine) as session:
            rows = [request_object(r) for r in pending_requests(session=session)]
    finally:
        engine.dispose()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no pending deletion requests")
    for r in rows:
        click.echo(f"{r['id']}  tenant {r['tenant']}  by {r['requested_by']}  reason: {r['reason'] or '-'}")
