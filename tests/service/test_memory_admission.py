"""Memory admission through the real API: a job whose estimated per-GPU peak (trainer.memory) is over
its partition's GPUs is refused at create with the figure, and the estimate route reports the figure
and whether it fits; a job that fits is admitted. Idle ranks: a chosen (auto) step budget is widened for
the GPUs asked for, an explicit one too small is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import Settings
from tests.service.conftest import TENANT_A, Gateway, chat_lines

pytestmark = [pytest.mark.service, pytest.mark.slurm]   # its tenant has a real Slurm account (sacctmgr)


@pytest.fixture
def gw_gpu(settings: Settings, tiny_catalog: Path) -> Iterator[Gateway]:
    """A site whose default partition has 1 GiB GPUs; tenant A has a Slurm account (up to 4 GPUs:
    ft-large), so its estimates reach the real cluster's admission and start estimate."""
    import os

    from gateway.slurm import LocalRunner
    from gateway.storage.onboarding import TenantAdmin

    if os.geteuid() != 0:
        pytest.skip("onboarding a Slurm tenant needs root")
    TenantAdmin(LocalRunner(), storage_root=settings.storage_root).add_tenant(TENANT_A, shares=5,
                                                                        qos=["ft-small", "ft-large"])
    g = Gateway(settings.model_copy(update={"default_model": "tiny-chat", "catalog_root": tiny_catalog,
                                            "gpu_memory_gib": {"default": 1.0}}))
    yield g
    g.app.state.engine.dispose()


def _file(gw: Gateway) -> str:
    obj = gw.upload(TENANT_A, chat_lines(30)).json()
    assert obj["status"] == "processed", obj
    return str(obj["id"])


def test_too_big_refused_with_the_figure_and_a_normal_job_admitted(gw_gpu: Gateway) -> None:
    from trainer.catalog import list_models, model_dir
    from trainer.memory import GIB, estimate, read_shape

    assert gw_gpu.app.state.submitter is not None, "needs the dev cluster's Slurm (scontrol ping)"
    fid, auth = _file(gw_gpu), gw_gpu.auth(TENANT_A)
    big = {"model": "tiny-chat", "training_file": fid,
           "hyperparameters": {"max_seq_len": 32768, "batch_size_tokens": 32768}}
    r = gw_gpu.client.post("/v1/fine_tuning/jobs", headers=auth, json=big)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    entry = next(e for e in list_models(gw_gpu.settings.models_root) if e.name == "tiny-chat")
    want = estimate(read_shape(model_dir(gw_gpu.settings.models_root, entry.name, entry.digest)), max_seq_len=32768)
    assert error["code"] == "insufficient_memory" and error["param"] == "hyperparameters"
    assert f"needs ~{want.total / GIB:.1f} GiB per GPU" in error["message"]
    assert "partition default's GPUs have 1.0 GiB" in error["message"]
    assert gw_gpu.client.get("/v1/fine_tuning/jobs", headers=auth).json()["data"] == []     # nothing recorded

    est = gw_gpu.client.post("/v1/fine_tuning/jobs/estimate", headers=auth, json=big)
    assert est.status_code == 200, est.text
    memory = est.json()["memory"]
    assert memory["fits"] is False and memory["per_gpu_gib"] == want.gib() and memory["limit_gib"] == 1.0
    assert memory["device"] == "cuda" and memory["breakdown"]["row_tokens"] == 32768
    assert any("needs ~" in w for w in est.json()["warnings"])

    normal = {"model": "tiny-chat", "training_file": fid}
    ok = gw_gpu.client.post("/v1/fine_tuning/jobs/estimate", headers=auth, json=normal)
    assert ok.status_code == 200, ok.text
    assert ok.json()["memory"]["fits"] is True and ok.json()["warnings"] == []


def test_idle_ranks_widened_by_default_refused_when_explicit(gw_gpu: Gateway) -> None:
    fid, auth = _file(gw_gpu), gw_gpu.auth(TENANT_A)
    four = {"gpus": 4, "nodes": 2}      # a dev node (32000 MB) takes two ranks of job_mem_mb
    r = gw_gpu.client.post("/v1/fine_tuning/jobs/estimate", headers=auth,
                           json={"model": "tiny-chat", "training_file": fid, "resources": four})
    assert r.status_code == 200, r.text
    assert r.json()["batch_size_tokens"] == 4 * 2048
    assert any("widened from the chosen 2048 to 8192" in w for w in r.json()["warnings"])   # auto: one row
    r = gw_gpu.client.post("/v1/fine_tuning/jobs/estimate", headers=auth, json={
        "model": "tiny-chat", "training_file": fid, "resources": four, "hyperparameters": {"batch_size_tokens": 4096}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "idle_ranks", r.text
    assert "set batch_size_tokens to at least 8192" in r.json()["error"]["message"]
