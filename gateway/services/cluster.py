"""The cluster as the admin pages show it: drained nodes and scrubs, usage and fairshare,
tenants and QOS tiers.

The composition root (``gateway.app``) binds the gateway's scheduler into one ``Cluster``
(``app.state.cluster``); the admin pages call its methods and get plain data back, so a
front end holds a service, never a Slurm adapter, and no route imports ``gateway.slurm``.
A failed Slurm command becomes ``ClusterError`` carrying the command's own words.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from accounting.fairshare import FairshareReport, fairshare_report
from accounting.gateway_facts import load_gateway_facts
from accounting.usage import GROUPINGS, UsageReport, usage_report
from accounting.window import AccountingError, make_window
from gateway.config import Settings
from gateway.errors import ClusterError, ServiceError, SlurmError
from gateway.slurm.policy import QosRow
from gateway.slurm.records import DrainedNode
from gateway.slurm.scheduler import Scheduler
from gateway.slurm.scrubreports import ScrubReport, latest_reports
from gateway.storage.onboarding import Tenant, TenantAdmin


def require_cluster(client: Scheduler | None) -> Scheduler:
    """``client`` when it reaches a real Slurm cluster; ServiceError (``no_backend``) when
    Slurm does not answer (None) or the gateway runs in local mode (a scheduler with no runner)."""
    if client is None:
        raise ServiceError("Slurm does not answer from this gateway: the cluster pages are unavailable.",
                           code="no_backend")
    if client.runner is None:      # local mode's scheduler: no cluster, accounts or usage to show
        raise ServiceError("This gateway runs in local mode: there is no Slurm cluster to report on.",
                           code="no_backend")
    return client


@dataclass(frozen=True)
class ClusterOverview:
    nodes: list[DrainedNode]
    scrubs: dict[str, list[ScrubReport]]
    error: str | None       # why ``nodes`` is empty when Slurm could not be asked


@dataclass(frozen=True)
class UsageOverview:
    report: UsageReport           # grouped as asked
    by_tenant: UsageReport        # the same window per tenant (what fairshare compares with)
    fairshare: FairshareReport


@dataclass(frozen=True)
class Cluster:
    """The cluster the admin pages show: ``scheduler`` is the gateway's (None when Slurm did not
    answer at start; local mode's has no cluster behind it)."""

    scheduler: Scheduler | None
    settings: Settings

    def overview(self) -> ClusterOverview:
        """Drained or down nodes with Slurm's reason (sinfo) and the newest scrub reports per node.
        Never raises for Slurm: a missing client or a failed sinfo is reported in ``error``."""
        nodes: list[DrainedNode] = []
        error = None
        if self.scheduler is None:
            error = "Slurm does not answer from this gateway."
        else:
            try:
                nodes = list(self.scheduler.drained_nodes())
            except SlurmError as e:
                error = f"sinfo failed: {e}"
        return ClusterOverview(nodes=nodes, scrubs=latest_reports(self.settings.scrub_report_dir, per_node=5),
                               error=error)

    def usage_and_fairshare(self, *, start: str, end: str, by: str) -> UsageOverview:
        """The usage report (sacct, with the gateway's own facts) over ``start``..``end`` grouped
        ``by``, and the fairshare report (sshare). Raises AccountingError for a bad grouping or
        date, ServiceError (``no_backend``) without a cluster, ClusterError when sacct/sshare fail."""
        if by not in GROUPINGS:
            raise AccountingError(f"group by {by!r} is not a grouping; valid: {', '.join(GROUPINGS)}")
        window = make_window(start, end)
        client, settings = require_cluster(self.scheduler), self.settings
        try:
            rows = list(client.sacct(window.start, window.end))
            now = datetime.now(UTC)
            facts = load_gateway_facts(settings.database_url, window)
            rep = usage_report(rows, window, by=by, now=now, facts=facts)
            by_tenant = rep if by == "tenant" else usage_report(rows, window, by="tenant", now=now, facts=facts)
            fs = fairshare_report(list(client.sshare()), by_tenant, parent=settings.parent_account)
        except SlurmError as e:
            raise ClusterError(str(e)) from e
        return UsageOverview(report=rep, by_tenant=by_tenant, fairshare=fs)

    def tenants_and_qos(self) -> tuple[list[Tenant], list[QosRow]]:
        """Tenants (Slurm accounts under the parent account) and the cluster's QOS tiers (sacctmgr).
        Raises ServiceError (``no_backend``) without a cluster, ClusterError when sacctmgr fails."""
        admin = TenantAdmin(require_cluster(self.scheduler).runner, storage_root=self.settings.storage_root,
                            parent_account=self.settings.parent_account)
        try:
            return admin.list_tenants(), admin.show_qos()
        except SlurmError as e:
            raise ClusterError(str(e)) from e
