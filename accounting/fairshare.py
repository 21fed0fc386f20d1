"""The fairshare report: what Slurm says (sshare) beside what tenants got (sacct GPU-seconds).

Entitled share of a tenant = its shares / the shares of all reported tenants.
Usage share = its GPU-seconds in the window / all reported tenants' GPU-seconds.
Jain's index J = (sum x)^2 / (n * sum x^2) over x = usage share / entitled share
of the *active* tenants (those with at least one job in the window: a tenant that
asked for nothing was not treated unfairly). J = 1 when every active tenant got
GPU time in proportion to its shares; 1/n when one tenant got all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from accounting.usage import UsageReport
from accounting.window import AccountingError, Window
from gateway.slurm.records import ShareRecord


@dataclass(frozen=True)
class FairshareRow:
    tenant: str
    raw_shares: int | None
    norm_shares: float | None        # sshare: shares / siblings' shares
    raw_usage: int | None            # sshare: decayed billing-seconds Slurm charges
    effective_usage: float | None    # sshare: usage / siblings' usage (decayed)
    fairshare: float | None          # sshare: the factor priority/multifactor uses (0..1)
    level_fs: float | None
    jobs: int                        # sacct, in the window
    gpu_seconds: float               # sacct, in the window
    entitled_share: float | None
    usage_share: float | None

    @property
    def ratio(self) -> float | None:
        """Usage share / entitled share: 1.0 = got exactly its entitlement."""
        if self.entitled_share is None or self.usage_share is None or self.entitled_share == 0:
            return None
        return self.usage_share / self.entitled_share


@dataclass(frozen=True)
class FairshareReport:
    window: Window
    generated_at: datetime
    rows: tuple[FairshareRow, ...]
    active: tuple[str, ...]
    jain_index: float | None          # over active tenants; None with no usage at all


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index of ``values``; None when empty or all zero."""
    square_sum = sum(v * v for v in values)
    if not values or square_sum == 0:
        return None
    return sum(values) ** 2 / (len(values) * square_sum)


def tenant_accounts(shares: Sequence[ShareRecord], parent: str) -> list[str]:
    """Accounts in sshare that are tenants: everything except root and the parent account."""
    seen: list[str] = []
    for r in shares:
        if r.is_account_row and r.account not in ("root", parent) and r.account not in seen:
            seen.append(r.account)
    return seen


def _factor(account: ShareRecord | None, users: list[ShareRecord]) -> float | None:
    """Classic fairshare prints the factor on the account row; fair tree only on user rows."""
    if account is not None and account.fairshare is not None:
        return account.fairshare
    factors = [u.fairshare for u in users if u.fairshare is not None]
    return min(factors) if factors else None


def fairshare_report(shares: Sequence[ShareRecord], usage: UsageReport, *,
                     tenants: Sequence[str] | None = None,
                     parent: str = "finetune") -> FairshareReport:
    """Per tenant: sshare figures, window usage, entitled vs usage share; Jain's index.

    ``usage`` must be grouped by tenant. ``tenants`` limits the report (and the
    share denominators) to those tenants; by default every tenant in sshare.
    Raises AccountingError for a usage report grouped otherwise or a tenant sshare lacks.
    """
    if usage.by != "tenant":
        raise AccountingError(f"the fairshare report needs usage by tenant, got --by {usage.by}")
    names = list(tenants) if tenants else tenant_accounts(shares, parent)
    acct_rows = {r.account: r for r in shares if r.is_account_row}
    missing = [t for t in names if t not in acct_rows]
    if missing:
        raise AccountingError(f"no sshare association for {', '.join(missing)}; "
                              f"known tenants: {', '.join(tenant_accounts(shares, parent)) or 'none'}")
    by_tenant = {r.key: r for r in usage.rows}
    share_sum = sum(acct_rows[t].raw_shares or 0 for t in names)
    gpu_sum = sum(by_tenant[t].gpu_seconds for t in names if t in by_tenant)
    rows = []
    for t in names:
        a, u = acct_rows[t], by_tenant.get(t)
        gpu_s = u.gpu_seconds if u else 0.0
        rows.append(FairshareRow(
            tenant=t, raw_shares=a.raw_shares, norm_shares=a.norm_shares, raw_usage=a.raw_usage,
            effective_usage=a.effective_usage,
            fairshare=_factor(a, [r for r in shares if r.account == t and not r.is_account_row]),
            level_fs=a.level_fs, jobs=u.jobs if u else 0, gpu_seconds=gpu_s,
            entitled_share=(a.raw_shares or 0) / share_sum if share_sum else None,
            usage_share=gpu_s / gpu_sum if gpu_sum else None,
        ))
    active = tuple(r.tenant for r in rows if r.jobs > 0)
    ratios = [r.ratio or 0.0 for r in rows if r.tenant in active]
    return FairshareReport(window=usage.window, generated_at=usage.generated_at, rows=tuple(rows),
                           active=active, jain_index=jain_index(ratios))
