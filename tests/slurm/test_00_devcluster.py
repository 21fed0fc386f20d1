"""`finetune dev-cluster down` stops exactly what `up` started; `up` is fast and idempotent."""

from __future__ import annotations

import os

import pytest

from gateway.devcluster.cluster import DevCluster

pytestmark = pytest.mark.slurm


def test_down_then_up_under_30s(cluster: None) -> None:
    dc = DevCluster(echo=print)
    before = dc.status()["daemons"]
    assert isinstance(before, dict) and before, "the dev cluster recorded no daemons"
    stopped = dc.down()
    assert {"slurmctld", "slurmdbd"} <= set(stopped)
    for name, d in before.items():
        assert not DevCluster._alive(d["pid"]), f"{name} (pid {d['pid']}) survived down"
    seconds = dc.up()
    print(f"\ndev-cluster up from stopped: {seconds:.1f}s")
    assert seconds < 30
    after = dc.status()
    assert all(d["alive"] for d in after["daemons"].values())  # type: ignore[union-attr]
    assert set(after["nodes"].values()) <= {"idle", "mixed", "allocated"}  # type: ignore[union-attr]
    assert dc.up() < 10, "a second up on a running cluster must be a quick no-op"
    assert os.path.exists("/dev/nvidia7")
