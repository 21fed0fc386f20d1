"""``finetune admin``: the sysadmin's commands (root on the gateway host).

Tenants (Slurm accounts, fairshare, QOS, unix users, storage), API tokens, the
audit log, QOS policy and drained nodes; ``accounting.cli`` adds ``report`` and
``fairshare``. Each command parses its options, calls one function of
``gateway.storage.onboarding``, ``gateway.access`` or ``gateway.services``, and prints.
The database layer (sqlalchemy, ~0.3 s) is imported by the commands that use it, so
``finetune``'s tenant commands, which only speak HTTP, start without it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gateway.config import get_settings
from gateway.errors import friendly_errors
from gateway.slurm import make_runner
from gateway.slurm.client import SlurmClient
from gateway.slurm.policy import diff_qos, load_policy, unmanaged_qos
from gateway.slurm.scrubreports import DEFAULT_REPORT_DIR, latest_reports
from gateway.slurm.validate import validate_tenant_name
from gateway.storage import storage_for
from gateway.storage.onboarding import TenantAdmin

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine


@click.group()
def admin() -> None:
    """Sysadmin commands: tenants, QOS tiers, nodes."""


@admin.group()
def tenant() -> None:
    """Tenant onboarding."""


def _admin() -> TenantAdmin:
    s = get_settings()
    return TenantAdmin(make_runner(s), storage_root=s.storage_root, parent_account=s.parent_account,
                       service_user=s.service_user)


@tenant.command("add")
@click.argument("name")
@click.option("--shares", type=click.IntRange(1, 1_000_000), default=1, show_default=True,
              help="Fairshare shares of the tenant's Slurm account.")
@click.option("--qos", "qos", required=True,
              help="Comma-separated QOS tiers; the first is the default.")
@click.option("--group", help="Unix group whose members are the tenant's members (as NSS reports it).")
@click.option("--admin-group", help="Unix group whose members are the tenant's admins.")
@friendly_errors
def tenant_add(name: str, shares: int, qos: str, group: str | None, admin_group: str | None) -> None:
    """Create (or update) tenant NAME: unix user, Slurm account + QOS, storage.

    The unix user (sft-NAME) is made here and recorded in /var/lib/slurm-finetune/tenant-users; a
    NAME whose user would be the service user, or an existing account this command did not make,
    is refused before anything is created.
    """
    from gateway.access.tokens import local_admin  # lazy: the DB layer, this command only
    from gateway.db import make_engine, migrate, session_scope  # lazy: the DB layer, this command only
    from gateway.services.tenants import ensure_tenant, set_people  # lazy: the DB layer, this command only

    validate_tenant_name(name)  # before anything runs
    t = _admin().add_tenant(name, shares=shares, qos=[q.strip() for q in qos.split(",")],
                            notify=lambda line: click.echo(line, err=True))
    engine = make_engine(get_settings().database_url)
    migrate(engine)
    with session_scope(engine) as session:
        ensure_tenant(session=session, name=name)
        if group is not None or admin_group is not None:
            set_people(session=session, name=name, by=local_admin().label, group=group,
                       admin_group=admin_group)
    click.echo(f"tenant {t.name}: unix user {t.unix_user} (uid {t.uid}), shares {t.shares}, "
               f"qos {','.join(t.qos)} (default {t.default_qos}), storage {t.storage}")
    if group or admin_group:
        click.echo(f"  members: group {group or '-'}, admins: group {admin_group or '-'}; they sign in with "
                   "`finetune login` on a cluster host")


@tenant.command("people")
@click.argument("name")
@click.option("--group", help="Unix group of the tenant's members ('' unbinds).")
@click.option("--admin-group", help="Unix group of the tenant's admins ('' unbinds).")
@click.option("--add", "add", multiple=True, metavar="USER", help="An explicit member (sites without groups).")
@click.option("--add-admin", "admins", multiple=True, metavar="USER", help="An explicit admin.")
@click.option("--remove", "remove", multiple=True, metavar="USER", help="Remove an explicit member or admin.")
@click.option("--json", "as_json", is_flag=True)
@friendly_errors
def tenant_people(name: str, group: str | None, admin_group: str | None, add: tuple[str, ...],
                  admins: tuple[str, ...], remove: tuple[str, ...], as_json: bool) -> None:
    """Who tenant NAME's people are: its unix groups and explicit members (shown; changed when given).

    Members sign in with `finetune login` (MUNGE, on a cluster host) or the portal's single
    sign-on; a user removed from a group loses access within a minute (their tokens check the
    groups again at most 30 s old)."""
    from gateway.access.audit import open_database  # lazy: the DB layer, this command only
    from gateway.access.tokens import local_admin  # lazy: the DB layer, this command only
    from gateway.db import session_scope  # lazy: the DB layer, this command only
    from gateway.services.tenants import people, set_people  # lazy: the DB layer, this command only

    with session_scope(open_database(get_settings())) as session:
        row = set_people(session=session, name=name, by=local_admin().label, group=group,
                         admin_group=admin_group,
                         add=add, admins=admins, remove=remove)
        out = {"tenant": name, **people(session=session, tenant=row)}
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"tenant {name}: members group {out['group'] or '-'}, admins group {out['admin_group'] or '-'}; "
               f"explicit members {', '.join(out['members']) or '-'}; "
               f"explicit admins {', '.join(out['admins']) or '-'}")


@tenant.command("retention")
@click.argument("name")
@click.option("--datasets", metavar="DAYS", help="Days to keep uploaded files (0 or 'off': forever).")
@click.option("--results", metavar="DAYS", help="Days to keep jobs' results: adapter.tar, eval.json, metrics.csv.")
@click.option("--checkpoints", metavar="DAYS",
              help="Days to keep published checkpoints, and a failed or cancelled job's training state.")
@click.option("--logs", metavar="DAYS", help="Days to keep a finished job's events.jsonl and Slurm output.")
@click.option("--json", "as_json", is_flag=True)
@friendly_errors
def tenant_retention(name: str, datasets: str | None, results: str | None, checkpoints: str | None,
                     logs: str | None, as_json: bool) -> None:
    """Show or set tenant NAME's retention policy: how long the sweeper keeps each kind of its data.

    A kind not set is kept forever. The sweeper (run by the gateway every SFT_SWEEP_INTERVAL_S) deletes
    what is older, never a file a job that has not ended uses; each deletion is in the tenant's audit log."""
    from gateway.access.audit import open_database  # lazy: the DB layer, this command only
    from gateway.access.tokens import local_admin  # lazy: the DB layer, this command only
    from gateway.db import session_scope  # lazy: the DB layer, this command only
    from gateway.services import retention  # lazy: the DB layer, this command only
    from gateway.services.tenants import get_tenant  # lazy: the DB layer, this command only

    given = {"datasets": datasets, "results": results, "checkpoints": checkpoints, "logs": logs}
    changes = {kind: retention.parse_days(v, kind) for kind, v in given.items() if v is not None}
    with session_scope(open_database(get_settings())) as session:
        row = retention.set_retention(session=session, tenant=get_tenant(session=session, name=name),
                                      by=local_admin().label, changes=changes)
        out = retention.retention_object(row)
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"tenant {name}: keeps " + ", ".join(
        f"{kind} {'forever' if days is None else f'{days} days'}" for kind, days in out["retention"].items()))


@admin.command("sweep")
@click.option("--dry-run", is_flag=True, help="Print what is due; delete nothing.")
@click.option("--json", "as_json", is_flag=True)
@friendly_errors
def admin_sweep(dry_run: bool, as_json: bool) -> None:
    """Run one retention sweep pass now (the gateway's leader runs one every SFT_SWEEP_INTERVAL_S): delete
    expired files, what is older than each tenant's retention policy, and succeeded jobs' training state
    beyond the checkpoints they keep. Bounded like the gateway's (SFT_SWEEP_MAX_ITEMS, SFT_SWEEP_BUDGET_S)."""
    from gateway.access.audit import open_database  # lazy: the DB layer, this command only
    from gateway.services.retention import sweep_pass  # lazy: the DB layer, this command only

    settings = get_settings()
    report = sweep_pass(open_database(settings), settings, storage=storage_for(settings), dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(report.as_dict()))
        return
    if dry_run:
        for t in report.tasks:
            click.echo(f"due: {t.what} {t.id} (tenant {t.tenant}, {t.reason})")
        click.echo(f"{len(report.tasks)} due, {report.held} held for jobs that have not ended")
        return
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(report.deleted.items())) or "-"
    stopped = f"; stopped: {report.stopped}" if report.stopped else ""
    click.echo(f"{report.count} deleted ({kinds}), {report.freed_bytes} bytes freed, {report.held} held for jobs "
               f"that have not ended, {report.errors} failed, {report.seconds:.2f}s{stopped}")


@tenant.command("modify")
@click.argument("name")
@click.option("--shares", type=click.IntRange(1, 1_000_000), help="New Fairshare shares.")
@click.option("--qos", "qos", help="New comma-separated QOS tiers; the first is the default.")
@click.option("--gpu-limit", help="GPUs the whole tenant may hold at once (GrpTRES=gres/gpu=N); 'none' removes it.")
@friendly_errors
def tenant_modify(name: str, shares: int | None, qos: str | None, gpu_limit: str | None) -> None:
    """Change tenant NAME's shares, QOS tiers or GPU limit (only what is given)."""
    validate_tenant_name(name)
    limit: int | None = None
    if gpu_limit is not None:
        if gpu_limit.strip().lower() == "none":
            limit = -1
        elif gpu_limit.strip().isdigit():
            limit = int(gpu_limit)
        else:
            raise click.BadParameter(f"{gpu_limit!r}: give a number of GPUs (0 or more) or 'none'",
                                     param_hint="--gpu-limit")
    adm = _admin()
    t = adm.modify_tenant(name, shares=shares, qos=[q.strip() for q in qos.split(",")] if qos else None,
                          gpu_limit=limit)
    gpus = adm.tenant_gpu_limit(name)
    click.echo(f"tenant {t.name}: shares {t.shares}, qos {','.join(t.qos)} (default {t.default_qos}), "
               f"gpu limit {'none' if gpus is None else gpus}")


@tenant.command("quota")
@click.argument("name")
@click.option("--space", metavar="SIZE", help="Space the tenant's storage may hold (20G, 500M, 1.5T; 'none' lifts it).")
@click.option("--files", "files", metavar="N", help="A limit on the number of files (not on btrfs: see below).")
@click.option("--json", "as_json", is_flag=True)
@friendly_errors
def tenant_quota(name: str, space: str | None, files: str | None, as_json: bool) -> None:
    """Show or set tenant NAME's storage quota, enforced by the filesystem.

    The tenant's storage is a btrfs subvolume; --space sets its qgroup's limit, so every write past it
    fails (an upload answers 507, a job's checkpoint fails as a user error). btrfs limits bytes only:
    --files is refused there, with the reason."""
    from gateway.access.audit import open_database  # lazy: the DB layer, this command only
    from gateway.access.tokens import local_admin  # lazy: the DB layer, this command only
    from gateway.db import session_scope  # lazy: the DB layer, this command only
    from gateway.services.storageuse import record_quota  # lazy: the DB layer, this command only
    from gateway.storage import quota  # lazy: this command only

    validate_tenant_name(name)
    if files is not None:
        raise click.BadParameter("this site's tenant storage is btrfs, whose quotas (qgroups) limit bytes, never a "
                                 "count of files: set --space only (a file limit needs user or project quotas of "
                                 "ext4, XFS, Lustre or GPFS)", param_hint="--files")
    adm = _admin()
    try:
        if space is None:
            fs = adm.storage_usage(name)
        else:
            try:
                limit = quota.parse_size(space)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--space") from None
            fs = adm.set_quota(name, limit)
            with session_scope(open_database(get_settings())) as session:
                record_quota(session=session, name=name, by=local_admin().label, space=limit)
    except FileNotFoundError:
        raise click.ClickException(f"tenant {name} has no storage root: onboard it with "
                                   f"`finetune admin tenant add {name} --qos ...`") from None
    except quota.QuotaError as e:
        raise click.ClickException(f"tenant {name}: {e}") from None
    if as_json:
        click.echo(json.dumps({"tenant": name, **fs.as_dict()}))
        return
    if fs.enforced_by is None:
        click.echo(f"tenant {name}: no quota is enforced here (the tenants directory is not btrfs with quotas on)")
        return
    share = f" ({100 * fs.used_bytes / fs.limit_bytes:.1f} %)" if fs.used_bytes is not None and fs.limit_bytes else ""
    click.echo(f"tenant {name}: {quota.human(fs.used_bytes)} used of "
               f"{quota.human(fs.limit_bytes) if fs.limit_bytes else 'no limit'}{share}, enforced by {fs.enforced_by}")
    if fs.used_bytes is not None and fs.limit_bytes and fs.used_bytes > fs.limit_bytes:
        click.echo(f"  warning: {name} is over its quota: its uploads and its jobs' checkpoints fail until it "
                   "frees space (or the quota is raised)", err=True)


@admin.command("operator")
@click.argument("user", required=False)
@friendly_errors
def admin_operator(user: str | None) -> None:
    """Make USER (default: the gateway's service user) a Slurm Operator: under PrivateData it must
    see and cancel every tenant's jobs. Idempotent."""
    name = user or get_settings().service_user
    changed = _admin().ensure_operator(name)
    click.echo(f"{name}: Slurm AdminLevel=Operator ({'set' if changed else 'already set'})")


@tenant.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@friendly_errors
def tenant_list(as_json: bool) -> None:
    """Tenants with their Slurm account, shares, QOS and storage state."""
    rows = _admin().list_tenants()
    if as_json:
        click.echo(json.dumps([{**t.__dict__, "storage": str(t.storage)} for t in rows], indent=2))
        return
    click.echo(f"{'TENANT':<20} {'UNIX USER':<24} {'SHARES':>6}  {'QOS':<28} STORAGE")
    for t in rows:
        click.echo(f"{t.name:<20} {t.unix_user:<24} {t.shares or '-':>6}  "
                   f"{','.join(t.qos):<28} {'ok' if t.storage_ok else 'MISSING/WRONG'}")


@admin.group()
def token() -> None:
    """API tokens. Every mint and revocation of a tenant's token is in that tenant's audit log."""


def _token_db() -> Engine:
    from gateway.access.audit import open_database  # lazy: the DB layer, this command only

    return open_database(get_settings())


@token.command("create")
@click.option("--tenant", "tenant_name", help="Tenant the token acts for (member, tenant_admin).")
@click.option("--role", type=click.Choice(["member", "tenant_admin", "sysadmin", "staff"]),
              default="member", show_default=True)
@click.option("--name", default="", help="A label shown in listings.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object holding the token.")
@friendly_errors
def token_create(tenant_name: str | None, role: str, name: str, as_json: bool) -> None:
    """Create an API token. It is printed once and stored only as a hash.

    The tenant's audit log records it as an alert, minted by "local admin CLI (uid N)". A
    tenant_admin token minted here decides no staff access request. For a tenant with no
    admin token of its own, a one-time claim code is written into the tenant's storage (as
    its unix user, 0600; never printed here): with it the holder makes the token the
    tenant's own (`finetune tokens claim`). Rotating it claims nothing.
    """
    from gateway.access.staff import db_now  # lazy: the DB layer, this command only
    from gateway.access.tokens import local_admin, operator_mint  # lazy: the DB layer, this command only
    from gateway.db import session_scope  # lazy: the DB layer, this command only
    from gateway.models import Role  # lazy: the DB layer, this command only
    from gateway.services.tenants import get_tenant  # lazy: the DB layer, this command only

    settings = get_settings()
    with session_scope(_token_db()) as session:
        tenant = get_tenant(session=session, name=tenant_name) if tenant_name else None
        minted = operator_mint(session=session, storage=storage_for(settings), role=Role(role), tenant=tenant,
                               name=name, minted_by=local_admin(), now=db_now(session))
    row = minted.row
    out = {"token": minted.secret, "id": row.id, "role": role, "tenant": tenant_name, "name": name,
           "minted_by": row.minted_by, "minted_by_operator": row.minted_by_operator,
           "claim_file": minted.claim_file,
           "claim_expires_at": row.claim_expires_at.isoformat() if row.claim_expires_at else None}
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"token #{row.id} (shown once): {minted.secret}")
    click.echo("  give it to its holder privately; they save it with `finetune login --url URL --token` (a "
               "prompt; or --token-stdin, or SFT_API_TOKEN for scripts), or paste it on the portal's sign-in "
               "page. People in a tenant's unix group need no token: `finetune login` on a cluster host")
    if minted.claim_file:
        click.echo(f"  a one-time claim code was written into {tenant_name}'s storage: {minted.claim_file} "
                   "(readable by the tenant's unix user only; not shown here)")
        click.echo(f"  until its holder claims it with that code (`finetune tokens claim --code-file "
                   f"{minted.claim_file}`, before {out['claim_expires_at']}), it decides no staff access request")
    elif role == "tenant_admin":
        click.echo(f"  it decides no staff access request: {tenant_name} has admin tokens of its own "
                   f"({', '.join(f'#{i}' for i in minted.own_admins)}), which mint ones that do")


@token.command("revoke")
@click.argument("token_id", type=click.IntRange(1, 2**31 - 1))
@click.option("--json", "as_json", is_flag=True)
@friendly_errors
def token_revoke(token_id: int, as_json: bool) -> None:
    """Revoke token TOKEN_ID (its tenant's audit log records it)."""
    from gateway.access.staff import db_now  # lazy: the DB layer, this command only
    from gateway.access.tokens import (  # lazy: the DB layer, this command only
        local_admin,
        revoke_token,
        token_object,
    )
    from gateway.db import session_scope  # lazy: the DB layer, this command only
    from gateway.models import ApiToken  # lazy: the DB layer, this command only

    with session_scope(_token_db()) as session:
        before = session.get(ApiToken, token_id)
        already = before is not None and before.revoked_at is not None
        out = token_object(revoke_token(session=session, token_id=token_id, revoked_by=local_admin(),
                                        now=db_now(session)))
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(f"token #{token_id}: " + ("was already revoked" if already else "revoked"))




@admin.group("audit")
def audit_group() -> None:
    """The hash-chained audit log of staff access, anchored by an HMAC key outside the database."""


@audit_group.command("verify")
@click.option("--key-file", type=click.Path(dir_okay=False, path_type=Path),
              help="The anchor key (default: SFT_AUDIT_KEY_FILE, the one the gateway signs with).")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON.")
@friendly_errors
def audit_verify(key_file: Path | None, as_json: bool) -> None:
    """Check every entry's hash and link, the head, and the head's HMAC under the key file.

    Exit 0: intact. Exit 1: tampering found (the first broken entry, or the head: newest
    entries deleted, head rewritten without the key). Exit 2: the chain is consistent but
    the anchor could not be checked (no usable key file here): not verified.
    """
    from gateway.access.audit import UNCHECKED, verify  # lazy: the DB layer, this command only

    settings = get_settings()
    verdict = verify(_token_db(), key_file=key_file or settings.audit_key_file)
    if as_json:
        click.echo(json.dumps({"ok": verdict.ok, "entries": verdict.entries, "head": verdict.head_hash,
                               "broken_seq": verdict.broken_seq, "problem": verdict.problem,
                               "anchor": verdict.anchor, "key_id": verdict.key_id}))
    else:
        click.echo(verdict.message())
    if not verdict.ok:
        sys.exit(2 if verdict.anchor == UNCHECKED else 1)


@audit_group.command("reanchor")
@click.option("--reason", required=True, help="Why (a ticket): recorded in the log with the verdict before.")
@click.option("--key-file", type=click.Path(dir_okay=False, path_type=Path),
              help="The anchor key (default: SFT_AUDIT_KEY_FILE); made if missing.")
@friendly_errors
def audit_reanchor(reason: str, key_file: Path | None) -> None:
    """Sign the head as it is now (after investigating a verdict, or for a database that is
    newer than its key file). Appends an audit.reanchor entry naming the verdict before; it
    hides no broken entry (verify still names those)."""
    from gateway.access import audit  # lazy: the DB layer, this command only
    from gateway.access.staff import db_now  # lazy: the DB layer, this command only
    from gateway.access.tokens import local_admin  # lazy: the DB layer, this command only

    engine = _token_db()
    if key_file is not None:
        audit.use_key_file(engine, key_file)
    before = audit.verify(engine, key_file=key_file or get_settings().audit_key_file)
    from sqlmodel import Session

    with Session(engine) as session:
        now = db_now(session)
    try:
        seq = audit.reanchor(engine, at=now, actor=audit.Actor(None, "sysadmin"),
                             reason=f"by {local_admin().label}: {reason}; before: {before.message()}")
    except audit.KeyUnavailable as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"before: {before.message()}")
    click.echo(f"re-anchored at entry {seq}: {audit.verify(engine, key_file=key_file).message()}")


@admin.group()
def qos() -> None:
    """QOS tiers."""


@qos.command("apply")
@click.argument("policy", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--dry-run", is_flag=True, help="Print the difference; change nothing.")
@friendly_errors
def qos_apply(policy: str | None, dry_run: bool) -> None:
    """Make the cluster's QOS tiers match POLICY (default: the shipped policy), changing only what differs."""
    from pathlib import Path


    tiers = load_policy(Path(policy) if policy else None)
    adm = _admin()
    cluster = adm.show_qos()

    changes = diff_qos(tiers, cluster)
    for c in changes:
        click.echo(("would " if dry_run else "") + c.describe())
    if not dry_run:
        adm.apply_qos_changes(changes)
    left = unmanaged_qos(tiers, cluster)
    click.echo(f"{len(tiers)} tiers in policy; {len(changes)} {'to change' if dry_run else 'changed'}"
               + (f"; not in policy, left alone: {', '.join(left)}" if left else ""))


@admin.command("nodes")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option("--last", type=click.IntRange(1, 100), default=2, show_default=True,
              help="Scrub reports to show per node.")
@click.option("--report-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the scrubber writes its reports (default /var/lib/slurm-finetune/scrub).")
@friendly_errors
def admin_nodes(as_json: bool, last: int, report_dir: Path | None) -> None:
    """Drained or down nodes with Slurm's reason, and the last scrub results per node."""
    nodes = SlurmClient(make_runner()).drained_nodes()
    scrubs = latest_reports(report_dir or DEFAULT_REPORT_DIR, per_node=last)
    if as_json:
        click.echo(json.dumps({
            "drained": [{**n.__dict__, "since": n.since.isoformat() if n.since else None} for n in nodes],
            "scrub": {node: [{"kind": r.kind, "job_id": r.job_id, "outcome": r.outcome,
                              "failed_steps": list(r.failed_steps), "started": r.started.isoformat(),
                              "seconds": r.seconds, "summary": r.summary(), "report": str(r.path)}
                             for r in reports] for node, reports in scrubs.items()},
        }, indent=2))
        return
    if not nodes:
        click.echo("no drained or down nodes")
    for n in nodes:
        since = n.since.isoformat() if n.since else "-"
        click.echo(f"{n.node:<16} {n.state:<12} {since:<26} {n.reason}")
    for node, reports in scrubs.items():
        click.echo(f"last scrubs on {node}:")
        for r in reports:
            click.echo(f"  {r.started.isoformat(timespec='seconds')}  {r.summary()}")
