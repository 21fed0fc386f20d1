"""Jobs larger than one GPU on the real dev cluster: a 2-node gang (gloo over its two slurmd
nodes, one rank per node), its loss curve against one process, a lost rank, a cancel, and the
QOS limit on GPUs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from gateway.slurm import LocalRunner, SlurmClient
from tests.slurm.livegateway import STORAGE, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
T = "t-gang"
# dropout 0: ranks draw their own dropout masks, so only a dropout-free run can match one process
GANG_HP = {"n_epochs": 1, "batch_size_tokens": 1024, "max_seq_len": 256, "checkpoint_every_steps": 2,
           "learning_rate_multiplier": 10, "lora_dropout": 0.0}
TWO_NODES = {"gpus": 2, "nodes": 2}


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("gang"), (T,))
    yield g
    g.stop()


@pytest.fixture(scope="module")
def train_file(gw: LiveGateway, tmp_path_factory: pytest.TempPathFactory) -> str:
    return gw.upload(T, chat_file(tmp_path_factory.mktemp("d") / "train.jsonl", 120, seed=21))


def _losses(gw: LiveGateway, job_id: str) -> dict[int, float]:
    r = gw.api("GET", f"/v1/fine_tuning/jobs/{job_id}/events", T, params={"limit": 1000})
    assert r.status_code == 200, r.text
    return {int(e["data"]["step"]): float(e["data"]["train_loss"]) for e in r.json()["data"]
            if e["type"] == "metrics" and "train_loss" in (e.get("data") or {})}


def _sacct(slurm_id: int, field: str) -> str:
    out = subprocess.run(["sacct", "-j", str(slurm_id), "-X", "-n", "-P", "-o", field],
                         capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[0] if out.strip() else ""


def _ranks(user: str) -> list[int]:
    done = subprocess.run(["pgrep", "-u", user, "-f", "-x", r"\S*/python3? -m trainer run .*"],  # not srun
                          capture_output=True, text=True, check=False)
    return [int(p) for p in done.stdout.split()]


def test_two_node_job_trains_publishes_and_matches_one_process(gw: LiveGateway, train_file: str) -> None:
    gang = gw.create(T, train_file, GANG_HP, resources=TWO_NODES, seed=5)
    single = gw.create(T, train_file, GANG_HP, seed=5)
    # ft-small allows 1 GPU per user
    limit = gang["resources"]["time_limit_minutes"]      # the estimate's: at least 5 minutes
    assert gang["resources"] == {**TWO_NODES, "fsdp": False, "time_limit_minutes": limit} and limit >= 5
    assert gang["qos"] == "ft-standard"
    done = gw.wait(T, gang["id"], terminal, 300)
    one = gw.wait(T, single["id"], terminal, 300)
    assert done["status"] == "succeeded", done["error"]
    assert one["status"] == "succeeded", one["error"]
    assert _sacct(done["slurm_job_id"], "NNodes") == "2"
    assert _sacct(one["slurm_job_id"], "NNodes") == "1"
    names = {gw.api("GET", f"/v1/files/{f}", T).json()["filename"] for f in done["result_files"]}
    assert {f"{gang['id']}-{n}" for n in ("adapter.tar", "eval.json", "metrics.csv")} <= names, names
    a, b = _losses(gw, gang["id"]), _losses(gw, single["id"])
    assert a.keys() == b.keys() and len(a) >= 3
    worst = max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-6) for s in a)
    print(f"\n2-node gang vs 1 process: {len(a)} steps, worst relative loss difference {worst:.2e}")
    assert worst < 1e-3, (a, b)
    cleaned = gw.wait(T, gang["id"], lambda j: j["cleanup"] in ("confirmed", "failed"), 60)
    assert cleaned["cleanup"] == "confirmed"     # both nodes' epilogs reported clean


def test_two_node_fsdp_job_shards_the_model_and_matches_one_process(gw: LiveGateway, train_file: str) -> None:
    """resources.fsdp: the 4-bit base sharded over the two nodes' ranks (FSDP2 over gloo)."""
    gang = gw.create(T, train_file, GANG_HP, resources={**TWO_NODES, "fsdp": True}, seed=5)
    single = gw.create(T, train_file, GANG_HP, seed=5)
    assert {k: v for k, v in gang["resources"].items() if k != "time_limit_minutes"} == {**TWO_NODES, "fsdp": True}
    done = gw.wait(T, gang["id"], terminal, 300)
    one = gw.wait(T, single["id"], terminal, 300)
    assert done["status"] == "succeeded", done["error"]
    assert one["status"] == "succeeded", one["error"]
    assert _sacct(done["slurm_job_id"], "NNodes") == "2"
    a, b = _losses(gw, gang["id"]), _losses(gw, single["id"])
    assert a.keys() == b.keys() and len(a) >= 3
    worst = max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-6) for s in a)
    print(f"\n2-node FSDP gang vs 1 process: {len(a)} steps, worst relative loss difference {worst:.2e}")
    assert worst < 1e-3, (a, b)
    log = next((STORAGE / "tenants" / T / "jobs" / gang["id"]).glob("slurm-*.out")).read_text()
    assert log.count("fsdp: 2 decoder layers sharded over 2 rank(s)") == 2   # both ranks, one on each node


def test_more_gpus_than_the_qos_allows_is_refused_with_the_limit(gw: LiveGateway, train_file: str) -> None:
    r = gw.api("POST", "/v1/fine_tuning/jobs", T, json={
        "model": "tiny-chat", "training_file": train_file, "hyperparameters": GANG_HP,
        "resources": {"gpus": 4, "nodes": 2}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "resources.gpus" and error["code"] == "gpu_limit"
    assert "at most 2 per user (ft-standard: MaxTRESPerUser=gres/gpu=2)" in error["message"]


def test_cancel_stops_every_rank_and_both_nodes_confirm_cleanup(gw: LiveGateway, train_file: str) -> None:
    hp = {**GANG_HP, "n_epochs": 30, "batch_size_tokens": 512}  # 2 rows a step: one per rank
    job = gw.create(T, train_file, hp, resources=TWO_NODES)
    gw.wait(T, job["id"], lambda j: (j["progress"].get("step") or 0) >= 2 or terminal(j), 240)
    assert len(_ranks(f"sft-{T}")) == 2
    t0 = time.monotonic()
    assert gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/cancel", T).status_code == 200
    done = gw.wait(T, job["id"], terminal, 60)
    took = time.monotonic() - t0
    print(f"\n2-node cancel: cancelled {took:.1f}s after the request")
    assert done["status"] == "cancelled" and done["stop_confirmed"] and done["result_files"] == []
    assert _ranks(f"sft-{T}") == []
    assert not SlurmClient(LocalRunner()).states([done["slurm_job_id"]])[done["slurm_job_id"]].active
    gw.kept_checkpoints(T, job["id"])       # a checkpoint it had is published first (issue 35)
    assert not list((STORAGE / "tenants" / T / "artifacts").glob(f".pub-{job['id']}*"))
    cleaned = gw.wait(T, job["id"], lambda j: j["cleanup"] in ("confirmed", "failed"), 60)
    assert cleaned["cleanup"] == "confirmed"


def test_a_killed_rank_requeues_the_gang_which_resumes_and_succeeds(gw: LiveGateway, train_file: str) -> None:
    hp = {**GANG_HP, "n_epochs": 6, "batch_size_tokens": 512}
    job = gw.create(T, train_file, hp, resources=TWO_NODES)
    gw.wait(T, job["id"], lambda j: (j["progress"].get("step") or 0) >= 4 or terminal(j), 240)
    ranks = _ranks(f"sft-{T}")
    assert len(ranks) == 2
    os.kill(max(ranks), signal.SIGKILL)                 # one rank dies without a word
    done = gw.wait(T, job["id"], terminal, 420)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempt"] >= 1                          # the gang ran again as a new attempt
    assert _sacct(done["slurm_job_id"], "NNodes") == "2"
    r = gw.api("GET", f"/v1/fine_tuning/jobs/{job['id']}/events", T, params={"limit": 1000})
    messages = [e["message"] for e in r.json()["data"]]
    assert any(m.startswith("Attempt 1 started") for m in messages), messages
