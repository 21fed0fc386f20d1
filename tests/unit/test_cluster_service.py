"""The admin pages' one door to Slurm (``services.cluster.Cluster``): the scheduler the composition
root bound in answers; without Slurm, or in local mode, the pages get words, never a Slurm adapter."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.services.cluster import Cluster
from gateway.slurm import SlurmClient
from gateway.slurm.local import LocalScheduler
from tests.slurmfake import FakeSlurm


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(storage_root=tmp_path / "s", state_dir=tmp_path / "state", scrub_report_dir=tmp_path / "scrub")


def test_the_overview_asks_the_bound_scheduler_for_drained_nodes(settings: Settings) -> None:
    fake = FakeSlurm()
    view = Cluster(SlurmClient(fake), settings).overview()
    assert view.error is None and view.nodes == [] and fake.count("sinfo") == 1


def test_without_slurm_the_overview_says_so_and_the_reports_refuse(settings: Settings) -> None:
    cluster = Cluster(None, settings)
    assert cluster.overview().error == "Slurm does not answer from this gateway."
    with pytest.raises(ServiceError, match="does not answer") as e:
        cluster.tenants_and_qos()
    assert e.value.code == "no_backend"


def test_local_mode_has_no_cluster_to_report_on(settings: Settings) -> None:
    cluster = Cluster(LocalScheduler(settings), settings)
    assert cluster.overview().nodes == []
    for report in (cluster.tenants_and_qos, lambda: cluster.usage_and_fairshare(start="-1d", end="now", by="tenant")):
        with pytest.raises(ServiceError, match="local mode"):
            report()
