"""The ``finetune`` command line. Commands parse input, call one function, print."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from gateway.cliutil import friendly_errors as friendly_errors  # re-exported: gateway.cli.friendly_errors
from gateway.config import get_settings
from gateway.slurm import make_runner


@click.group()
@click.version_option(package_name="slurm-finetune")
def main() -> None:
    """slurm-finetune: private QLoRA fine-tuning on a shared SLURM cluster."""


# ------------------------------------------------------------------ dev-cluster
@main.group("dev-cluster")
def dev_cluster() -> None:
    """The one-host development cluster (root): munge, MariaDB, slurmdbd, slurmctld, 2 slurmd."""


@dev_cluster.command("up")
@friendly_errors
def dev_cluster_up() -> None:
    """Install what is missing, render configs, start the daemons, apply QOS tiers."""
    from gateway.slurm.devcluster import DevCluster

    dc = DevCluster(echo=click.echo)
    seconds = dc.up()
    click.echo(f"dev cluster up in {seconds:.1f}s: nodes {dc.node_states()}")


@dev_cluster.command("down")
@friendly_errors
def dev_cluster_down() -> None:
    """Stop the daemons `up` started (and only those)."""
    from gateway.slurm.devcluster import DevCluster

    stopped = DevCluster(echo=click.echo).down()
    click.echo("stopped: " + (", ".join(stopped) or "nothing was running"))


@dev_cluster.command("status")
@friendly_errors
def dev_cluster_status() -> None:
    """Daemons with their PIDs, and node states. Exit 1 if a recorded daemon is dead."""
    from gateway.slurm.devcluster import DevCluster

    st = DevCluster(echo=click.echo).status()
    click.echo(json.dumps(st, indent=2))
    daemons = st["daemons"]
    assert isinstance(daemons, dict)
    if not daemons or not all(d["alive"] for d in daemons.values()):
        sys.exit(1)


# ------------------------------------------------------------------------ admin
@main.group()
def admin() -> None:
    """Sysadmin commands: tenants, QOS tiers, nodes."""


@admin.group()
def tenant() -> None:
    """Tenant onboarding."""


def _admin():  # type: ignore[no-untyped-def]
    from gateway.slurm.admin import Admin

    s = get_settings()
    return Admin(make_runner(s), storage_root=s.storage_root, parent_account=s.parent_account)


@tenant.command("add")
@click.argument("name")
@click.option("--shares", type=click.IntRange(1, 1_000_000), default=1, show_default=True,
              help="Fairshare shares of the tenant's Slurm account.")
@click.option("--qos", "qos", required=True,
              help="Comma-separated QOS tiers; the first is the default.")
@friendly_errors
def tenant_add(name: str, shares: int, qos: str) -> None:
    """Create (or update) tenant NAME: unix user, Slurm account + QOS, storage."""
    from gateway.db import make_engine, migrate, session_scope
    from gateway.services.tenants import ensure_tenant
    from gateway.slurm.validate import validate_tenant_name

    validate_tenant_name(name)  # before anything runs
    t = _admin().add_tenant(name, shares=shares, qos=[q.strip() for q in qos.split(",")])
    engine = make_engine(get_settings().database_url)
    migrate(engine)
    with session_scope(engine) as session:
        ensure_tenant(session=session, name=name)
    click.echo(f"tenant {t.name}: unix user {t.unix_user} (uid {t.uid}), shares {t.shares}, "
               f"qos {','.join(t.qos)} (default {t.default_qos}), storage {t.storage}")


@tenant.command("modify")
@click.argument("name")
@click.option("--shares", type=click.IntRange(1, 1_000_000), help="New Fairshare shares.")
@click.option("--qos", "qos", help="New comma-separated QOS tiers; the first is the default.")
@click.option("--gpu-limit", help="GPUs the whole tenant may hold at once (GrpTRES=gres/gpu=N); 'none' removes it.")
@friendly_errors
def tenant_modify(name: str, shares: int | None, qos: str | None, gpu_limit: str | None) -> None:
    """Change tenant NAME's shares, QOS tiers or GPU limit (only what is given)."""
    from gateway.slurm.validate import validate_tenant_name

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


def _token_db():  # type: ignore[no-untyped-def]
    from gateway.db import open_database

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

    The tenant's audit log records it, minted by "local admin CLI (uid N)". A tenant_admin
    token minted here decides no staff access request until its holder claims it with
    `finetune tokens rotate` (which also revokes this copy).
    """
    from gateway.db import session_scope
    from gateway.models import Role
    from gateway.services.staff import db_now
    from gateway.services.tenants import get_tenant
    from gateway.services.tokens import create_token, local_admin

    with session_scope(_token_db()) as session:
        tenant = get_tenant(session=session, name=tenant_name) if tenant_name else None
        secret, row = create_token(session=session, role=Role(role), tenant=tenant, name=name,
                                   minted_by=local_admin(), now=db_now(session))
    out = {"token": secret, "id": row.id, "role": role, "tenant": tenant_name, "name": name,
           "minted_by": row.minted_by, "minted_by_operator": row.minted_by_operator}
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"token #{row.id} (shown once): {secret}")
    if role == "tenant_admin":
        click.echo(f"  it decides no staff access request until {tenant_name}'s admin claims it: "
                   "`finetune tokens rotate` (the new token replaces this one)")


@token.command("revoke")
@click.argument("token_id", type=click.IntRange(1, 2**31 - 1))
@click.option("--json", "as_json", is_flag=True)
@friendly_errors
def token_revoke(token_id: int, as_json: bool) -> None:
    """Revoke token TOKEN_ID (its tenant's audit log records it)."""
    from gateway.db import session_scope
    from gateway.models import ApiToken
    from gateway.services.staff import db_now
    from gateway.services.tokens import local_admin, revoke_token, token_object

    with session_scope(_token_db()) as session:
        before = session.get(ApiToken, token_id)
        already = before is not None and before.revoked_at is not None
        out = token_object(revoke_token(session=session, token_id=token_id, revoked_by=local_admin(),
                                        now=db_now(session)))
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(f"token #{token_id}: " + ("was already revoked" if already else "revoked"))


def _mount_token_commands() -> None:
    from gateway.usercli import tokens

    main.add_command(tokens)


_mount_token_commands()


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
    from gateway.audit import UNCHECKED, verify

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
    from gateway import audit
    from gateway.services.staff import db_now
    from gateway.services.tokens import local_admin

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

    from gateway.slurm.policy import load_policy, unmanaged_qos

    tiers = load_policy(Path(policy) if policy else None)
    adm = _admin()
    cluster = adm.show_qos()
    from gateway.slurm.policy import diff_qos

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
    from gateway.scrub import DEFAULT_REPORT_DIR, latest_reports
    from gateway.slurm.client import SlurmClient

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


def local_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--local`` / ``--data-dir``: the same command in local mode (gateway/local.py)."""
    fn = click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                      help="Local mode's data (default ~/.local/share/slurm-finetune); implies --local.")(fn)
    return click.option("--local", is_flag=True,
                        help="Local mode: no root, no Slurm; jobs run as you, NO tenant isolation "
                             "(also SFT_BACKEND=local).")(fn)


def _settings(local: bool, data_dir: Path | None):  # type: ignore[no-untyped-def]
    """Settings from the environment, in local mode when asked; local mode announces itself."""
    from gateway.config import Settings

    over: dict[str, Any] = {"backend": "local"} if local or data_dir else {}
    if data_dir:
        over["data_dir"] = data_dir
    settings = Settings(**over) if over else get_settings()
    if settings.local:
        from gateway.local import banner, prepare

        prepare(settings)
        click.secho(banner(settings), fg="yellow", bold=True, err=True)
    return settings


@main.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1, 64),
              help="API processes; with more than one, this process runs the single reconciler.")
@click.option("--log-level", default="info", show_default=True)
@local_options
@friendly_errors
def serve(host: str, port: int, workers: int, log_level: str, local: bool, data_dir: Path | None) -> None:
    """Serve the HTTP API and portal (settings from SFT_* environment variables)."""
    import uvicorn

    from gateway.api.app import create_app
    from gateway.privsep import become_service_user

    settings = _settings(local, data_dir)
    if settings.local:
        _local_first_start(settings, f"http://{host}:{port}")
        workers = 1                    # the app and its reconciler in this one process
    become_service_user(settings)      # root: state dir + storage broker, then drop for good
    if workers == 1:
        uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level)
        return
    reconciler = _reconciler(settings)
    if reconciler is not None:
        import threading

        threading.Thread(target=reconciler.run, name="reconciler", daemon=True).start()
    uvicorn.run("gateway.api.app:worker_app", factory=True, host=host, port=port, workers=workers,
                log_level=log_level)


def _local_first_start(settings: Any, url: str) -> None:
    """Local mode's first start: tenant ``local`` and its token, saved where `finetune login` saves."""
    from gateway.local import onboard
    from gateway.usercli import save_credentials

    token = onboard(settings, "local")
    if token is not None:
        from gateway.usercli import saved_url

        if saved_url() not in (None, url):      # logged in elsewhere: do not replace that login
            click.echo(f"tenant 'local' created; its token (shown once): {token}\n"
                       f"  use it: finetune login --url {url} --token {token}", err=True)
        else:
            path = save_credentials(url, token)
            click.echo(f"tenant 'local' created; its token is saved in {path}: `finetune files upload "
                       f"FILE` and the other commands use it", err=True)
    from trainer import catalog

    if not catalog.list_models(settings.models_root):
        click.echo(f"no base model yet: `finetune models make-tiny /tmp/tiny --register tiny-chat --root "
                   f"{settings.models_root}` (seconds) or `finetune models import-smollm2 --root "
                   f"{settings.models_root}`", err=True)


def _reconciler(settings):  # type: ignore[no-untyped-def]
    from gateway.backend import build_backend

    reconciler = build_backend(settings).reconciler
    if reconciler is None:
        click.echo("Slurm does not answer: no reconciler", err=True)
    return reconciler


@main.command("reconcile")
@click.option("--once", is_flag=True, help="Run one cycle, print what it did, and exit.")
@friendly_errors
def reconcile(once: bool) -> None:
    """Run the reconciler alone (when the API runs elsewhere or with several workers)."""
    from gateway.privsep import become_service_user

    settings = get_settings()
    become_service_user(settings)
    rec = _reconciler(settings)
    if rec is None:
        sys.exit(1)
    if once:
        stats = rec.cycle()
        click.echo(f"{stats.jobs} active jobs, {stats.slurm_calls} Slurm queries, {stats.changed} changed, "
                   f"{stats.published} published" + (f", errors: {stats.errors}" if stats.errors else ""))
        return
    rec.run()


@main.command("broker")
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), default=None,
              help="Unix socket (default: SFT_BROKER_SOCKET).")
def broker(socket_path: Path | None) -> None:
    """Run the storage broker (root): tenant-storage verbs as the tenant, for the gateway's
    service user only. `finetune serve` started as root starts one itself when none answers."""
    from gateway.storage.broker import main as broker_main

    settings = get_settings()
    broker_main(["--socket", str(socket_path or settings.broker_socket),
                 "--allow-user", settings.service_user])


@main.command("demo")
@click.option("--tiny", is_flag=True, help="The tiny random model instead of SmolLM2-135M-Instruct: a quick "
              "check of the plumbing (seconds of training), nothing a person can read.")
@local_options
@friendly_errors
def demo(tiny: bool, local: bool, data_dir: Path | None) -> None:
    """End-to-end walk-through: tenant, base model, dataset, QLoRA job, before/after.

    On the dev cluster (root), or with --local as an ordinary user without Slurm."""
    from gateway.demo import run_demo

    sys.exit(run_demo(_settings(local, data_dir), echo=click.echo, tiny=tiny))


def _mount_user_commands() -> None:
    from gateway.usercli import access, artifacts, audit, files, jobs, login, staff

    main.add_command(login)
    main.add_command(files)
    main.add_command(jobs)
    main.add_command(artifacts)
    for group in (staff, access, audit):
        main.add_command(group)


_mount_user_commands()


def _mount_optional_groups() -> None:
    # The model catalog lives in trainer/ (it runs on compute nodes too); its CLI
    # imports no torch at module level, so mounting it keeps `finetune` light.
    try:
        from trainer.cli import models
    except ImportError:
        return
    main.add_command(models, "models")


def _mount_accounting() -> None:
    try:
        from accounting.cli import register
    except ImportError:
        return
    register(admin)


_mount_accounting()


_mount_optional_groups()
