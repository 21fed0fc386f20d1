"""Fairshare on the real cluster: a tenant that used GPUs ranks below one that did not."""

from __future__ import annotations

import time

import pytest

from gateway.slurm import SlurmClient
from gateway.storage.layout import unix_user_for
from tests.slurm.conftest import finished, submit, wait_for

pytestmark = pytest.mark.slurm


def test_sshare_ranks_light_tenant_above_heavy(client: SlurmClient, tenants: tuple[str, str],
                                               fairshare_load: list[int] | None) -> None:
    a, b = tenants
    ids = fairshare_load or [submit(client, a, "sleep 5")[0] for _ in range(2)]
    for j in ids:
        wait_for(client, j, finished, 60)
    ua, ub = unix_user_for(a), unix_user_for(b)
    deadline = time.monotonic() + 150  # usage is folded in every PriorityCalcPeriod (1 min)
    while True:
        rows = {r.user: r for r in client.sshare() if r.user in (ua, ub)}
        ra, rb = rows[ua], rows[ub]
        assert ra.raw_usage is not None and rb.raw_usage is not None
        if ra.fairshare is not None and rb.fairshare is not None \
                and ra.raw_usage > rb.raw_usage and rb.fairshare > ra.fairshare:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"sshare never ranked {b} above {a}: {ra} {rb}")
        time.sleep(3)
    print(f"\nfairshare {a}: usage {ra.raw_usage} factor {ra.fairshare}; "
          f"{b}: usage {rb.raw_usage} factor {rb.fairshare}")
