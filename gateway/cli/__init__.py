"""The ``finetune`` command line: one click group and the command groups it mounts.

- ``gateway.cli.service``: ``serve``, ``reconcile``, ``broker``, ``demo``, ``dev-cluster``;
- ``gateway.cli.sysadmin``: ``admin ...`` (tenants, tokens, audit, QOS, nodes; reports
  from ``accounting.cli``);
- ``gateway.usercli``: the tenant's commands over HTTP (``login``, ``files``, ``jobs``,
  ``artifacts``, ``tokens``, ``staff``, ``access``, ``audit``);
- ``trainer.cli``: ``models`` (the base-model catalog; it lives with the trainer,
  which runs on compute nodes too).

Commands parse input, call one function, print; errors become one line through
``gateway.errors.friendly_errors``. A group whose package is not installed is
left out.
"""

from __future__ import annotations

import click

from gateway.cli.service import broker, demo, dev_cluster, reconcile, serve
from gateway.cli.sysadmin import admin, tenant
from gateway.cli.tenantdelete import tenant_delete, tenant_delete_requests
from gateway.usercli import access, artifacts, audit, deletion, files, jobs, login, staff, sweeps, tokens, webhooks
from gateway.usercli.models import bundle_model, list_aliases, promote_model, show_model


@click.group()
@click.version_option(package_name="slurm-finetune")
def main() -> None:
    """slurm-finetune: private QLoRA fine-tuning on a shared SLURM cluster."""


for _command in (dev_cluster, admin, serve, reconcile, broker, demo,
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
