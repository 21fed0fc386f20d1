"""Many tenants at once: 4 tenants x (5 uploads + 2 jobs), all in parallel against one
gateway. Every upload is stored once under its tenant, every job runs once and ends
correctly, nobody sees anybody else's objects."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.conftest import scancel_tenants
from tests.reliability.faultlib import assert_consistent
from tests.slurm.livegateway import FAST_HP, MODEL, LiveGateway, chat_file, terminal

pytestmark = [pytest.mark.slurm, pytest.mark.heavy]
TENANTS = ("t-rel-c1", "t-rel-c2", "t-rel-c3", "t-rel-c4")
HP = {**FAST_HP, "max_steps": 6}


@pytest.fixture
def gw(cluster: None, tmp_path: Path) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path, TENANTS)
    yield g
    g.stop()
    scancel_tenants(*TENANTS)


def test_four_tenants_upload_and_submit_at_once(gw: LiveGateway, tmp_path: Path) -> None:
    since = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S")
    files: dict[str, list[dict[str, Any]]] = {t: [] for t in TENANTS}
    jobs: dict[str, list[dict[str, Any]]] = {t: [] for t in TENANTS}
    errors: list[str] = []
    barrier = threading.Barrier(len(TENANTS) * 5)

    def upload(t: str, i: int) -> None:
        path = chat_file(tmp_path / f"{t}-{i}.jsonl", 30, seed=100 + i)   # same content across tenants
        barrier.wait()
        with open(path, "rb") as f:
            r = gw.api("POST", "/v1/files", t, data={"purpose": "fine-tune"}, files={"file": (path.name, f)})
        if r.status_code != 200 or r.json()["status"] != "processed":
            errors.append(f"upload {t}/{i}: {r.status_code} {r.text[:200]}")
        else:
            files[t].append(r.json())

    threads = [threading.Thread(target=upload, args=(t, i)) for t in TENANTS for i in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    barrier2 = threading.Barrier(len(TENANTS) * 2)

    def create(t: str, i: int) -> None:
        barrier2.wait()
        r = gw.api("POST", "/v1/fine_tuning/jobs", t, headers={"Idempotency-Key": f"conc-{i}"},
                   json={"model": MODEL, "training_file": files[t][i]["id"], "hyperparameters": HP})
        if r.status_code != 200:
            errors.append(f"create {t}/{i}: {r.status_code} {r.text[:200]}")
        else:
            jobs[t].append(r.json())

    threads = [threading.Thread(target=create, args=(t, i)) for t in TENANTS for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    for t in TENANTS:
        assert len({f["id"] for f in files[t]}) == 5
        listed = {f["id"] for f in gw.api("GET", "/v1/files", t).json()["data"]}
        assert listed == {f["id"] for f in files[t]}, t        # exactly its own five, nobody else's
        others = {f["id"] for o in TENANTS if o != t for f in files[o]}
        assert not listed & others
    final = {t: [gw.wait(t, j["id"], terminal, 600) for j in jobs[t]] for t in TENANTS}
    for t in TENANTS:
        assert [j["status"] for j in final[t]] == ["succeeded", "succeeded"], [j["error"] for j in final[t]]
        listed_jobs = {j["id"] for j in gw.api("GET", "/v1/fine_tuning/jobs", t).json()["data"]}
        assert listed_jobs == {j["id"] for j in jobs[t]}
        assert_consistent(gw, t, since, {j["id"]: "succeeded" for j in jobs[t]})
