"""Running the service: ``serve``, ``reconcile``, ``broker``, ``demo`` and ``dev-cluster``.

Each builds its settings (``--local`` / ``--data-dir`` switch to local mode) and hands
over to the composition root (``gateway.jobs.backend``), the API app, the storage broker or
the demo; ``serve`` and ``reconcile`` drop root first (``gateway.cli.privsep``). The app,
the DB layer and the demo are imported by the commands that run them: ``finetune`` starts
without them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from gateway.cli.privsep import become_service_user
from gateway.config import Settings, get_settings
from gateway.devcluster.cluster import DevCluster, DevClusterConfig, short_hostname
from gateway.errors import friendly_errors
from gateway.slurm.local import banner, prepare
from gateway.storage.broker import main as broker_main
from gateway.usercli import save_credentials, saved_url


# ------------------------------------------------------------------ dev-cluster
@click.group("dev-cluster")
def dev_cluster() -> None:
    """The one-host development cluster (root): munge, MariaDB, slurmdbd, slurmctld, 2 slurmd."""


@dev_cluster.command("up")
@click.option("--sim-nodes", type=click.IntRange(0, 200), default=0, show_default=True,
              help="Also run this many simulated nodes (partition 'sim', fake GPUs as the real nodes') "
                   "for capacity runs (bench/capacity.py); 0 removes them.")
@click.option("--sim-gpus-per-node", type=click.IntRange(1, 16), default=8, show_default=True)
@friendly_errors
def dev_cluster_up(sim_nodes: int, sim_gpus_per_node: int) -> None:
    """Install what is missing, render configs, start the daemons, apply QOS tiers."""
    cfg = DevClusterConfig(host=short_hostname(), sim_nodes=sim_nodes, sim_gpus_per_node=sim_gpus_per_node)
    dc = DevCluster(cfg, echo=click.echo)
    seconds = dc.up()
    click.echo(f"dev cluster up in {seconds:.1f}s: nodes {dc.node_states()}")


@dev_cluster.command("down")
@friendly_errors
def dev_cluster_down() -> None:
    """Stop the daemons `up` started (and only those)."""
    stopped = DevCluster(echo=click.echo).down()
    click.echo("stopped: " + (", ".join(stopped) or "nothing was running"))


@dev_cluster.command("status")
@friendly_errors
def dev_cluster_status() -> None:
    """Daemons with their PIDs, and node states. Exit 1 if a recorded daemon is dead."""
    st = DevCluster(echo=click.echo).status()
    click.echo(json.dumps(st, indent=2))
    daemons = st["daemons"]
    assert isinstance(daemons, dict)
    if not daemons or not all(d["alive"] for d in daemons.values()):
        sys.exit(1)


# ------------------------------------------------------------------------ admin


def local_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--local`` / ``--data-dir``: the same command in local mode (gateway/slurm/local.py)."""
    fn = click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                      help="Local mode's data (default ~/.local/share/slurm-finetune); implies --local.")(fn)
    return click.option("--local", is_flag=True,
                        help="Local mode: no root, no Slurm; jobs run as you, NO tenant isolation "
                             "(also SFT_BACKEND=local).")(fn)


def _settings(local: bool, data_dir: Path | None):  # type: ignore[no-untyped-def]
    """Settings from the environment, in local mode when asked; local mode announces itself."""
    over: dict[str, Any] = {"backend": "local"} if local or data_dir else {}
    if data_dir:
        over["data_dir"] = data_dir
    settings = Settings(**over) if over else get_settings()
    if settings.local:
        prepare(settings)
        click.secho(banner(settings), fg="yellow", bold=True, err=True)
    return settings


@click.command("serve")
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

    from gateway.app import create_app  # lazy: FastAPI and every route, only for the commands that serve

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
    uvicorn.run("gateway.app:worker_app", factory=True, host=host, port=port, workers=workers,
                log_level=log_level)


def _local_first_start(settings: Any, url: str) -> None:
    """Local mode's first start: tenant ``local`` and its token, saved where `finetune login` saves."""
    from gateway.services.tenants import onboard_empty  # lazy: the DB layer, only for a first local start

    token = onboard_empty(settings, "local", name="local")
    if token is not None:
        if saved_url() not in (None, url):      # logged in elsewhere: do not replace that login
            click.echo(f"tenant 'local' created; its token (shown once): {token}\n"
                       f"  use it: finetune login --url {url} --token   (paste it at the prompt)", err=True)
        else:
            path = save_credentials(url, token)
            click.echo(f"tenant 'local' created; its token is saved in {path}: `finetune files upload "
                       f"FILE` and the other commands use it", err=True)
    from trainer import catalog  # lazy: the trainer side, only to hint at a first model

    if not catalog.list_models(settings.models_root):
        click.echo(f"no base model yet: `finetune models make-tiny /tmp/tiny --register tiny-chat --root "
                   f"{settings.models_root}` (seconds) or `finetune models import-smollm2 --root "
                   f"{settings.models_root}`", err=True)


def _reconciler(settings):  # type: ignore[no-untyped-def]
    from gateway.jobs.backend import build_backend  # lazy: the DB layer and the reconciler, this command only

    reconciler = build_backend(settings).reconciler
    if reconciler is None:
        click.echo("Slurm does not answer: no reconciler", err=True)
    return reconciler


@click.command("reconcile")
@click.option("--once", is_flag=True, help="Run one cycle, print what it did, and exit.")
@friendly_errors
def reconcile(once: bool) -> None:
    """Run the reconciler alone (when the API runs elsewhere or with several workers)."""
    settings = get_settings()
    become_service_user(settings)
    rec = _reconciler(settings)
    if rec is None:
        sys.exit(1)
    if once:
        if not rec.lease.hold():
            click.echo("another gateway holds the reconciler lease (gateway.jobs.leader): it reconciles; "
                       "nothing done", err=True)
            sys.exit(1)
        rec.fence = rec.lease
        try:
            stats = rec.cycle()
        finally:
            rec.lease.release()
        click.echo(f"{stats.jobs} active jobs, {stats.slurm_calls} Slurm queries, {stats.changed} changed, "
                   f"{stats.published} published" + (f", errors: {stats.errors}" if stats.errors else ""))
        return
    rec.run()


@click.command("broker")
@click.option("--socket", "socket_path", type=click.Path(path_type=Path), default=None,
              help="Unix socket (default: SFT_BROKER_SOCKET).")
def broker(socket_path: Path | None) -> None:
    """Run the storage broker (root): tenant-storage verbs as the tenant, for the gateway's
    service user only. `finetune serve` started as root starts one itself when none answers."""
    settings = get_settings()
    broker_main(["--socket", str(socket_path or settings.broker_socket),
                 "--allow-user", settings.service_user])


@click.command("demo")
@click.option("--tiny", is_flag=True, help="The tiny random model instead of SmolLM2-135M-Instruct: a quick "
              "check of the plumbing (seconds of training), nothing a person can read.")
@click.option("--time", "time_limit", type=click.IntRange(1, 24 * 60), metavar="MINUTES",
              help="The job's time limit instead of the estimate's (a slow or busy machine).")
@local_options
@friendly_errors
def demo(tiny: bool, time_limit: int | None, local: bool, data_dir: Path | None) -> None:
    """End-to-end walk-through: tenant, base model, dataset, QLoRA job, before/after.

    On the dev cluster (root), or with --local as an ordinary user without Slurm. A job that fails
    (a time limit on a slow machine) leaves its checkpoints: the demo prints the command that
    continues from the newest."""
    from gateway.cli.demo import run_demo  # lazy: the demo's DB layer and HTTP client, this command only

    sys.exit(run_demo(_settings(local, data_dir), echo=click.echo, tiny=tiny, time_limit_min=time_limit))
