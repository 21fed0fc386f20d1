"""The ``finetune`` command line. Commands parse input, call one function, print."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from gateway.config import get_settings
from gateway.slurm import make_runner
from gateway.slurm.runner import SlurmError


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn our errors into one clear line and exit 1; never a stack trace."""
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (SlurmError, ValueError, KeyError) as e:
            raise click.ClickException(str(e).strip("'\"")) from e
    return wrapper


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
    from gateway.slurm.validate import validate_tenant_name

    validate_tenant_name(name)  # before anything runs
    t = _admin().add_tenant(name, shares=shares, qos=[q.strip() for q in qos.split(",")])
    click.echo(f"tenant {t.name}: unix user {t.unix_user} (uid {t.uid}), shares {t.shares}, "
               f"qos {','.join(t.qos)} (default {t.default_qos}), storage {t.storage}")


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
def qos() -> None:
    """QOS tiers."""


@qos.command("apply")
@click.argument("policy", required=False, type=click.Path(exists=True, dir_okay=False))
@friendly_errors
def qos_apply(policy: str | None) -> None:
    """Create or update the QOS tiers of POLICY (default: the shipped policy)."""
    from pathlib import Path

    from gateway.slurm.policy import load_policy

    tiers = load_policy(Path(policy) if policy else None)
    created = _admin().apply_qos(tiers)
    click.echo(f"applied {len(tiers)} tiers; created: {', '.join(created) or 'none'}")


@admin.command("nodes")
@friendly_errors
def admin_nodes() -> None:
    """Drained or down nodes with Slurm's reason."""
    from gateway.slurm.client import SlurmClient

    nodes = SlurmClient(make_runner()).drained_nodes()
    if not nodes:
        click.echo("no drained or down nodes")
    for n in nodes:
        since = n.since.isoformat() if n.since else "-"
        click.echo(f"{n.node:<16} {n.state:<12} {since:<26} {n.reason}")


@main.command("demo")
@friendly_errors
def demo() -> None:
    """End-to-end walk-through on the dev cluster (root): tenant, model, data, QLoRA job."""
    from gateway.demo import run_demo

    sys.exit(run_demo(get_settings(), echo=click.echo))


def _mount_optional_groups() -> None:
    # The model catalog lives in trainer/ (it runs on compute nodes too); its CLI
    # imports no torch at module level, so mounting it keeps `finetune` light.
    try:
        from trainer.cli import models
    except ImportError:
        return
    main.add_command(models, "models")


_mount_optional_groups()
