"""DPO jobs end to end on the real cluster (issue 21): preference files validated on upload, a DPO job
through the official openai client that raises the held-out preference accuracy and reward margin, DPO
from the tenant's own supervised model (lineage), the CLI's --method dpo --beta, a killed rank of a DPO
gang resuming to the very adapter of an uninterrupted run, cancel as for SFT, and the method and file
format refused when they disagree."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.slurm import LocalRunner, SlurmClient
from tests.slurm.livegateway import FAST_HP, MODEL, ROOT, STORAGE, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
A, B = "t-dpo-a", "t-dpo-b"
DPO_HP = {"n_epochs": 2, "batch_size_tokens": 768, "max_seq_len": 256, "checkpoint_every_steps": 4,
          "learning_rate_multiplier": 50, "beta": 0.1}
GANG_HP = {**DPO_HP, "n_epochs": 3, "lora_dropout": 0.0, "checkpoint_every_steps": 2}  # dropout 0: see test_gang


def dpo(hp: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's ``method`` object of a DPO job."""
    return {"type": "dpo", "dpo": {"hyperparameters": hp or DPO_HP}}


def pref_file(path: Path, n: int, seed: int) -> Path:
    from trainer.toydata import toy_preferences, write_jsonl

    return write_jsonl(path, toy_preferences(n, seed=seed))


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("dpo"), (A, B))
    yield g
    g.stop()


@pytest.fixture(scope="module")
def files(gw: LiveGateway, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("data")
    return {"train": gw.upload(A, pref_file(d / "pairs.jsonl", 160, seed=1)),
            "val": gw.upload(A, pref_file(d / "pairs-val.jsonl", 40, seed=2)),
            "chat": gw.upload(A, chat_file(d / "chat.jsonl", 60, seed=3))}


def _result(gw: LiveGateway, job: dict[str, Any], name: str) -> bytes:
    for fid in job["result_files"]:
        if gw.api("GET", f"/v1/files/{fid}", A).json()["filename"].endswith(name):
            return gw.api("GET", f"/v1/files/{fid}/content", A).content
    raise AssertionError(f"no {name} among {job['result_files']}")


def _adapter(gw: LiveGateway, job: dict[str, Any]) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(_result(gw, job, "adapter.tar"))) as tar:
        member = tar.extractfile(f"{job['id']}/adapter_model.safetensors")
        assert member is not None
        return member.read()


def test_a_preference_file_is_validated_as_one(gw: LiveGateway, files: dict[str, str]) -> None:
    stats = gw.api("GET", f"/v1/files/{files['train']}", A).json()["validation"]["stats"]
    print(f"\npreference upload: {json.dumps(stats.get('preference'))}")
    assert stats.get("format") == "preference" and stats["preference"]["pairs"] == 160
    assert stats["preference"]["chosen"]["max"] > 0 and stats["preference"]["rejected"]["max"] > 0


def test_dpo_job_raises_heldout_preference_accuracy_and_reward_margin(gw: LiveGateway, files: dict[str, str]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=gw.url + "/v1", api_key=gw.tokens[A], max_retries=0)
    job = client.fine_tuning.jobs.create(model=MODEL, training_file=files["train"], validation_file=files["val"],
                                         suffix="dpo", method=dpo())  # type: ignore[arg-type]
    assert job.method is not None and job.method.type == "dpo"
    done = gw.wait(A, job.id, terminal, 300)
    assert done["status"] == "succeeded", done["error"]
    assert done["method"]["type"] == "dpo" and done["method"]["dpo"]["hyperparameters"]["beta"] == 0.1
    evaluation = json.loads(_result(gw, done, "eval.json"))
    before, after = evaluation["before"], evaluation["after"]
    print(f"\nDPO on the cluster: held-out loss {before['loss']:.3f} -> {after['loss']:.3f}, reward accuracy "
          f"{before['reward_accuracy']:.2f} -> {after['reward_accuracy']:.2f}, reward margin "
          f"{before['reward_margin']:.3f} -> {after['reward_margin']:.3f} ({after['pairs']} pairs)")
    assert after["reward_accuracy"] > before["reward_accuracy"] + 0.3
    assert after["reward_margin"] > before["reward_margin"] + 0.5 and after["loss"] < before["loss"]
    messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=500).data]
    assert any(m.startswith("Eval (after") and "reward accuracy=" in m for m in messages), messages
    assert any(m == "Phase: reference" for m in messages)
    assert [e["when"] for e in done["progress"]["evals"]] == ["before", "after"]
    assert done["progress"]["evals"][-1]["reward_accuracy"] == after["reward_accuracy"]
    spec = json.loads((STORAGE / "tenants" / A / "jobs" / job.id / "spec.json").read_text())
    assert spec["method"] == "dpo" and spec["hyperparameters"]["beta"] == 0.1


def test_dpo_from_the_tenants_supervised_model_records_its_lineage(gw: LiveGateway, files: dict[str, str]) -> None:
    sft = gw.create(A, files["chat"], FAST_HP, suffix="sft")
    sft = gw.wait(A, sft["id"], terminal, 300)
    assert sft["status"] == "succeeded", sft["error"]
    parent = sft["fine_tuned_model"]
    # B cannot start from A's model: a foreign model is not found
    b_file = gw.upload(B, pref_file(gw.workdir / "b-pairs.jsonl", 40, seed=7))
    r = gw.api("POST", "/v1/fine_tuning/jobs", B, json={"model": parent, "training_file": b_file, "method": dpo()})
    assert r.status_code == 404, r.text
    child = gw.create(A, files["train"], None, model=parent, validation_file=files["val"], method=dpo(),
                      hyperparameters=None)
    child = gw.wait(A, child["id"], terminal, 300)
    assert child["status"] == "succeeded", child["error"]
    assert child["model"] == parent and child["method"]["type"] == "dpo"
    lineage = gw.api("GET", f"/v1/models/{child['fine_tuned_model']}", A).json()["lineage"]
    print(f"\nDPO child of {parent}: method {lineage['method']}, eval {lineage['eval']}")
    assert lineage["parent"] == parent and lineage["method"] == "dpo" and lineage["spec"]["method"] == "dpo"
    assert lineage["eval"]["reward_accuracy_after"] > lineage["eval"]["reward_accuracy_before"]
    evaluation = json.loads(_result(gw, child, "eval.json"))
    assert evaluation["before"]["reward_accuracy"] == 0.5  # the reference is the parent itself
    assert evaluation["after"]["reward_accuracy"] > 0.8


def test_method_and_file_format_must_agree(gw: LiveGateway, files: dict[str, str]) -> None:
    cases = [
        ({"training_file": files["chat"], "method": dpo()}, "training_file", "invalid_file"),
        ({"training_file": files["train"]}, "training_file", "invalid_file"),
        ({"training_file": files["train"], "validation_file": files["chat"], "method": dpo()},
         "validation_file", "invalid_file"),
        ({"training_file": files["chat"], "hyperparameters": {"beta": 0.2}}, "hyperparameters", None),
        ({"training_file": files["train"], "method": {"type": "supervised", "dpo": {"hyperparameters": {}}}},
         None, None),
        ({"training_file": files["train"], "method": dpo({"max_seq_len": 512, "batch_size_tokens": 768})},
         "hyperparameters", None),
    ]
    for body, param, code in cases:
        r = gw.api("POST", "/v1/fine_tuning/jobs", A, json={"model": MODEL, **body})
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert "Traceback" not in r.text and (param is None or error["param"] == param), (body, error)
        assert code is None or error["code"] == code, (body, error)
        print(f"\n{param}: {error['message'][:160]}")


def test_cli_creates_a_dpo_job_with_its_beta(gw: LiveGateway, files: dict[str, str]) -> None:
    env = {**gw.env, "SFT_API_URL": gw.url, "SFT_API_TOKEN": gw.tokens[A]}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    made = cli("jobs", "create", "--training-file", files["train"], "--model", MODEL, "--method", "dpo",
               "--beta", "0.25", "--epochs", "1", "--batch-size-tokens", "768", "--max-seq-len", "256", "--json")
    assert made.returncode == 0, made.stderr
    job = json.loads(made.stdout)
    assert job["method"]["type"] == "dpo" and job["method"]["dpo"]["hyperparameters"]["beta"] == 0.25
    shown = cli("jobs", "show", job["id"])
    assert "method:" in shown.stdout and "dpo" in shown.stdout and "beta=0.25" in shown.stdout, shown.stdout
    wrong = cli("jobs", "create", "--training-file", files["train"], "--model", MODEL, "--beta", "0.25")
    assert wrong.returncode == 2 and "--method dpo" in wrong.stderr and "Traceback" not in wrong.stderr
    gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/cancel", A)
    assert gw.wait(A, job["id"], terminal, 120)["status"] in ("cancelled", "succeeded")


def test_cancel_during_dpo_training(gw: LiveGateway, files: dict[str, str]) -> None:
    job = gw.create(A, files["train"], None, method=dpo({**DPO_HP, "n_epochs": 20}), hyperparameters=None)
    gw.wait(A, job["id"], lambda j: j["phase"] == "training" and (j["progress"].get("step") or 0) >= 2
            or terminal(j), 240)
    t0 = time.monotonic()
    r = gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/cancel", A)
    assert r.status_code == 200 and r.json()["status"] == "cancelling"
    done = gw.wait(A, job["id"], terminal, 60)
    print(f"\nDPO cancel: cancelled {time.monotonic() - t0:.1f}s after the request")
    assert done["status"] == "cancelled" and done["stop_confirmed"]
    assert done["result_files"] == [] and done["fine_tuned_model"] is None
    assert not SlurmClient(LocalRunner()).states([done["slurm_job_id"]])[done["slurm_job_id"]].active
    assert subprocess.run(["pgrep", "-u", f"sft-{A}", "-f", "trainer"], capture_output=True).returncode == 1


def _ranks(user: str) -> list[int]:
    done = subprocess.run(["pgrep", "-u", user, "-f", "-x", r"\S*/python3? -m trainer run .*"],
                          capture_output=True, text=True, check=False)
    return [int(p) for p in done.stdout.split()]


def test_a_killed_rank_of_a_dpo_gang_resumes_to_the_uninterrupted_runs_adapter(
        gw: LiveGateway, files: dict[str, str]) -> None:
    """Data-parallel DPO over two nodes: SIGKILL one rank mid-run; the gang requeues, resumes from its
    checkpoint (and its reference log-probs) and publishes the adapter an uninterrupted gang publishes,
    bit for bit."""
    two = {"gpus": 2, "nodes": 2}
    killed = gw.create(A, files["train"], None, method=dpo(GANG_HP), hyperparameters=None, resources=two, seed=11)
    gw.wait(A, killed["id"], lambda j: (j["progress"].get("step") or 0) >= 5 or terminal(j), 300)
    ranks = _ranks(f"sft-{A}")
    assert len(ranks) == 2, ranks
    os.kill(max(ranks), signal.SIGKILL)
    killed = gw.wait(A, killed["id"], terminal, 420)
    assert killed["status"] == "succeeded", killed["error"]
    assert killed["attempt"] >= 1
    jdir = STORAGE / "tenants" / A / "jobs" / killed["id"]
    trainer_events = [json.loads(x) for x in (jdir / "events.jsonl").read_text().splitlines()]
    resumed = [e.get("resumed_from_step") for e in trainer_events if e["type"] == "start" and e.get("attempt")]
    assert any(step and step > 0 for step in resumed), resumed
    clean = gw.create(A, files["train"], None, method=dpo(GANG_HP), hyperparameters=None, resources=two, seed=11)
    clean = gw.wait(A, clean["id"], terminal, 420)
    assert clean["status"] == "succeeded", clean["error"]
    print(f"\nDPO gang: killed one rank, resumed from {resumed}; adapters equal: "
          f"{_adapter(gw, killed) == _adapter(gw, clean)}")
    assert _adapter(gw, killed) == _adapter(gw, clean)
    assert json.loads(_result(gw, killed, "eval.json"))["after"] == json.loads(_result(gw, clean, "eval.json"))["after"]
