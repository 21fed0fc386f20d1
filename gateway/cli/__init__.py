"""The ``finetune`` command line: one click group and the command groups it mounts.

- ``gateway.cli.service``: ``serve``, ``reconcile``, ``broker``, ``demo``, ``dev-cluster``;
- ``gateway.cli.sysadmin``: ``admin ...`` (tenants, tokens, audit, QOS, nodes; reports
  from ``accounting.cli``);
- ``gateway.usercli``: the tenant's commands over HTTP (``login``, ``files``, ``jobs``,
  ``artifacts``, ``tokens``, ``staff``, ``access``, ``audit``);
- ``trainer.cli``: ``models`` (the base-model catalog; it lives with the trainer,
  which runs on compute nodes too).

Commands parse input, call one function, print; errors become one line through
``gateway.errors.friendly_errors``, and anything else a command raises (a file it may not
write, a database it may not open, a gateway that does not answer) becomes one line too
(:class:`_Finetune`): never a stack trace, unless ``SFT_DEBUG=1`` asks for it. A group whose
package is not installed is left out.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from gateway.cli.manpage import completion, man
from gateway.cli.service import broker, demo, dev_cluster, reconcile, serve
from gateway.cli.sysadmin import admin, tenant
from gateway.cli.tenantdelete import tenant_delete, tenant_delete_requests
from gateway.usercli import access, artifacts, audit, deletion, files, jobs, login, staff, sweeps, tokens, webhooks
from gateway.usercli.client import ApiError
from gateway.usercli.models import bundle_model, list_aliases, promote_model, show_model


def _one_line(e: BaseException) -> str:
    """What went wrong, in one line a user can act on (no stack trace)."""
    if isinstance(e, PermissionError):
        where = f" {e.filename}" if e.filename else ""
        return (f"permission denied{where}: run it from a directory you can write, or as a user allowed "
                "to (an admin command needs root or the service user)")
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"no such file or directory: {e.filename}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}{f': {e.filename}' if e.filename else ''}"
    text = " ".join(str(e).split())
    if type(e).__name__ == "OperationalError" and "unable to open database file" in text:
        return ("cannot open the gateway's database: admin commands run as root or the service user "
                "(sudo finetune admin ...), on the gateway's host (SFT_DATABASE_URL)")
    if type(e).__module__.startswith("httpx") or type(e).__name__ in ("ConnectError", "ConnectTimeout"):
        return f"cannot reach the gateway ({text or type(e).__name__}): check SFT_API_URL or `finetune login`"
    return f"{type(e).__name__}: {text[:500]}" if text else type(e).__name__


def _json_error(e: click.ClickException) -> None:
    """A command run with ``--json`` that fails: OpenAI's error object on stderr, exit 1."""
    error = ({**e.error, "status": e.status} if isinstance(e, ApiError)
             else {"message": e.format_message(), "type": "cli_error", "code": None, "param": None, "status": None})
    click.echo(json.dumps({"error": error}), err=True)
    sys.exit(1)


class _Finetune(click.Group):
    """The top group: an exception no command turned into a message still ends as one line on
    stderr and exit 1 (click's own errors, exits and Ctrl-C pass through as click prints them)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["finetune.argv"] = list(args)       # whether --json was asked for (errors then print JSON)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError:
            raise
        except click.ClickException as e:
            if "--json" not in ctx.meta.get("finetune.argv", ()):
                raise
            _json_error(e)          # one shape for scripts: {"error": {...}} on stderr, exit 1
        except (click.exceptions.Exit, click.Abort, SystemExit, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - the one place the CLI turns any failure into a line
            if os.environ.get("SFT_DEBUG") == "1":
                raise
            if "--json" in ctx.meta.get("finetune.argv", ()):
                _json_error(click.ClickException(_one_line(e)))
            click.echo(f"Error: {_one_line(e)}", err=True)
            sys.exit(1)


@click.group(cls=_Finetune)
@click.version_option(package_name="slurm-finetune")
def main() -> None:
    """slurm-finetune: private QLoRA fine-tuning on a shared SLURM cluster."""


for _command in (dev_cluster, admin, serve, reconcile, broker, demo, completion, man,
                 login, files, jobs, sweeps, artifacts, tokens, staff, access, audit, webhooks, deletion):
    main.add_command(_command)
for _command in (tenant_delete, tenant_delete_requests):     # deleting a tenant (gateway.cli.tenantdelete)
    tenant.add_command(_command)


def _mount_optional_groups() -> None:
    # Only a package that is not installed is left out: any other ImportError (a partial import,
    # a broken module) is raised, never a group silently missing from `finetune`.
    try:
        from accounting.cli import register  # lazy: an optional group: mounted only when its package is installed
    except ModuleNotFoundError as e:
        if e.name != "accounting":
            raise
    else:
        register(admin)
    # The model catalog's CLI imports no torch at module level, so mounting it keeps `finetune` light.
    try:
        from trainer.cli import models  # lazy: an optional group: mounted only when its package is installed
    except ModuleNotFoundError as e:
        if e.name != "trainer":
            raise
        return

    for name, command in (("show", show_model), ("bundle", bundle_model), ("promote", promote_model),
                          ("aliases", list_aliases)):
        models.add_command(command, name)    # a tenant's models over HTTP: record, promotion, aliases
    main.add_command(models, "models")


_mount_optional_groups()
