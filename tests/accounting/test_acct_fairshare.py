"""The fairshare report on recorded sshare + sacct output; Jain's index."""

from __future__ import annotations

import pytest

from accounting.fairshare import fairshare_report, jain_index, tenant_accounts
from accounting.usage import usage_report
from accounting.window import AccountingError
from gateway.slurm import records as rec
from tests.accounting.conftest import ACCT_DATA, RECORDED_AT, sacct
from tests.accounting.test_acct_usage import HOUR


def _shares() -> list[rec.ShareRecord]:
    return rec.parse_sshare((ACCT_DATA / "sshare_tenants.txt").read_text())


def test_tenants_are_accounts_below_the_parent() -> None:
    names = tenant_accounts(_shares(), "finetune")
    assert "root" not in names and "finetune" not in names
    assert {"t-acct-a", "t-acct-b", "t-scrub-b"} <= set(names)


def test_usage_share_vs_entitled_share_for_two_tenants() -> None:
    usage = usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT)
    fs = fairshare_report(_shares(), usage, tenants=["t-acct-a", "t-acct-b"])
    a, b = fs.rows
    assert (a.raw_shares, b.raw_shares) == (10, 10)
    assert a.entitled_share == b.entitled_share == 0.5
    assert a.usage_share == pytest.approx(106 / 153) and b.usage_share == pytest.approx(47 / 153)
    assert a.ratio == pytest.approx(2 * 106 / 153)
    # sshare's own figures are passed through: fair tree prints the factor on the user row
    assert a.fairshare == pytest.approx(0.166667) and a.norm_shares == pytest.approx(0.1)
    assert a.effective_usage == pytest.approx(0.249464) and a.raw_usage == 105
    x = [2 * 106 / 153, 2 * 47 / 153]
    assert fs.jain_index == pytest.approx(sum(x) ** 2 / (2 * sum(v * v for v in x)))


def test_unequal_shares_and_idle_tenants() -> None:
    usage = usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT)
    fs = fairshare_report(_shares(), usage, tenants=["t-acct-a", "t-scrub-b"])
    a, idle = fs.rows
    assert a.entitled_share == pytest.approx(10 / 15) and idle.entitled_share == pytest.approx(5 / 15)
    assert idle.jobs == 0 and idle.usage_share == 0
    # the idle tenant asked for nothing: it does not lower the index
    assert fs.active == ("t-acct-a",) and fs.jain_index == 1.0


def test_all_tenants_by_default() -> None:
    usage = usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT)
    fs = fairshare_report(_shares(), usage)
    assert len(fs.rows) == len(tenant_accounts(_shares(), "finetune"))
    assert sum(r.entitled_share or 0 for r in fs.rows) == pytest.approx(1)


def test_unknown_tenant_lists_the_known_ones() -> None:
    usage = usage_report([], HOUR, now=RECORDED_AT)
    with pytest.raises(AccountingError, match="no sshare association for nope; known tenants: acme"):
        fairshare_report(_shares(), usage, tenants=["nope"])


def test_needs_usage_by_tenant() -> None:
    with pytest.raises(AccountingError, match="by tenant"):
        fairshare_report(_shares(), usage_report([], HOUR, by="day", now=RECORDED_AT))


@pytest.mark.parametrize(("values", "expected"), [
    ([1, 1, 1, 1], 1.0), ([1, 0, 0, 0], 0.25), ([2, 1], 0.9), ([], None), ([0, 0], None)])
def test_jain_index(values: list[float], expected: float | None) -> None:
    assert jain_index(values) == (None if expected is None else pytest.approx(expected))
