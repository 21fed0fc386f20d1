"""The model registry on the real cluster: a published model's lineage against the files on disk,
continued training from it and from one of its checkpoints (the child starts at the parent's eval
loss there), checkpoints as models, and tenant scoping."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.slurm.livegateway import FAST_HP, MODEL, STORAGE, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
A, B = "t-lin-a", "t-lin-b"
HP = {**FAST_HP, "lora_r": 4, "lora_alpha": 8, "eval_every_steps": 3, "keep_checkpoints": 3}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("lineage"), (A, B))
    yield g
    g.stop()


@pytest.fixture(scope="module")
def files(gw: LiveGateway, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("d")
    return {"train": gw.upload(A, chat_file(d / "train.jsonl", 80, seed=31)),
            "val": gw.upload(A, chat_file(d / "val.jsonl", 20, seed=32))}


@pytest.fixture(scope="module")
def parent(gw: LiveGateway, files: dict[str, str]) -> dict[str, Any]:
    job = gw.create(A, files["train"], HP, validation_file=files["val"], seed=7, suffix="parent")
    done = gw.wait(A, job["id"], terminal, 300)
    assert done["status"] == "succeeded", done["error"]
    return done


def _model(gw: LiveGateway, tenant: str, model_id: str) -> Any:
    return gw.api("GET", f"/v1/models/{quote(model_id, safe=':')}", tenant)


def _result(gw: LiveGateway, job: dict[str, Any], name: str) -> str:
    return next(f for f in job["result_files"] if gw.api("GET", f"/v1/files/{f}", A).json()["filename"].endswith(name))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_record_matches_the_files_on_disk_and_the_training(gw: LiveGateway, files: dict[str, str],
                                                               parent: dict[str, Any]) -> None:
    r = _model(gw, A, parent["fine_tuned_model"])
    assert r.status_code == 200, r.text
    lin = r.json()["lineage"]
    on_disk = STORAGE / "tenants" / A / "datasets"
    assert lin["training_file"]["id"] == files["train"] and lin["validation_file"]["id"] == files["val"]
    uploaded = gw.api("GET", f"/v1/files/{files['train']}/content", A).content
    assert hashlib.sha256(uploaded).hexdigest() == lin["training_file"]["sha256"]
    assert _sha(on_disk / f"{lin['training_file']['sha256']}.jsonl") == lin["training_file"]["sha256"]
    assert _sha(on_disk / f"{lin['validation_file']['sha256']}.jsonl") == lin["validation_file"]["sha256"]
    catalog = gw.api("GET", f"/v1/models/{MODEL}", A).json()
    assert lin["base_model"] == {"name": MODEL, "digest": catalog["digest"]}
    # the hyperparameters it trained with: resolved, and the trainer reported the same spec hash
    hp = lin["hyperparameters"]
    assert (hp["epochs"], hp["lora_r"], hp["lora_alpha"], hp["seed"], hp["batch_size_tokens"]) == (1, 4, 8, 7, 512)
    assert lin["spec_verified"] is True and lin["trainer"]["spec_hash"] == lin["spec_hash"]
    assert lin["trainer"]["versions"]["torch"] and lin["trainer"]["versions"]["peft"]
    # every result file's sha256 is that of the bytes in the tenant's artifacts
    on_record = {(p.name, _sha(p)) for p in (STORAGE / "tenants" / A / "artifacts").glob("art-*/*")}
    for name, digest in lin["results"].items():
        assert (name, digest.removeprefix("sha256:")) in on_record, name
    ev = json.loads(gw.api("GET", f"/v1/files/{_result(gw, parent, 'eval.json')}/content", A).content)
    assert lin["eval"]["after"] == pytest.approx(ev["after"]["loss"])
    assert lin["eval"]["before"] == pytest.approx(ev["before"]["loss"])
    slurm = lin["slurm"]
    assert (slurm["job_id"], slurm["account"], slurm["attempts"], slurm["gpus"]) == \
        (parent["slurm_job_id"], A, parent["attempt"] + 1, 1)
    assert slurm["qos"] == parent["qos"] and slurm["training_gpu_seconds"] > 0
    assert lin["parent"] is None


def test_another_tenant_sees_no_record_and_cannot_continue_it(gw: LiveGateway, parent: dict[str, Any],
                                                              tmp_path: Path) -> None:
    assert _model(gw, B, parent["fine_tuned_model"]).status_code == 404
    theirs = gw.upload(B, chat_file(tmp_path / "b.jsonl", 40, seed=33))
    r = gw.api("POST", "/v1/fine_tuning/jobs", B, json={"model": parent["fine_tuned_model"],
                                                        "training_file": theirs, "hyperparameters": HP})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def test_a_continued_job_starts_at_its_parents_eval_loss(gw: LiveGateway, files: dict[str, str],
                                                         parent: dict[str, Any]) -> None:
    r = gw.api("POST", "/v1/fine_tuning/jobs", A, json={
        "model": parent["fine_tuned_model"], "training_file": files["train"], "validation_file": files["val"],
        "hyperparameters": {**FAST_HP, "lora_r": 16}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "hyperparameters.lora_r", r.text
    r = gw.api("POST", "/v1/fine_tuning/jobs", A, json={
        "model": parent["fine_tuned_model"], "training_file": files["train"], "hyperparameters": {"lora_r": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "hyperparameters.lora_r", r.text
    child = gw.create(A, files["train"], FAST_HP, model=parent["fine_tuned_model"],
                      validation_file=files["val"], suffix="child")
    assert child["model"] == parent["fine_tuned_model"]      # OpenAI's way: the model it started from
    done = gw.wait(A, child["id"], terminal, 300)
    assert done["status"] == "succeeded", done["error"]
    lin = _model(gw, A, done["fine_tuned_model"]).json()["lineage"]
    parents = _model(gw, A, parent["fine_tuned_model"]).json()["lineage"]
    print(f"\nparent's final eval loss {parents['eval']['after']:.6f}, the child's before it trained "
          f"{lin['eval']['before']:.6f}; a fresh adapter starts at {parents['eval']['before']:.4f}")
    assert lin["parent"] == parent["fine_tuned_model"] and lin["base_model"] == parents["base_model"]
    assert lin["hyperparameters"]["lora_r"] == 4 and lin["hyperparameters"]["lora_alpha"] == 8   # inherited
    assert lin["eval"]["before"] == pytest.approx(parents["eval"]["after"], rel=1e-4)
    assert lin["spec_verified"] is True


def test_finetune_models_show_prints_the_lineage(gw: LiveGateway, parent: dict[str, Any], tmp_path: Path) -> None:
    from trainer.contract.spec import parse_spec, spec_hash

    env = {**gw.env, "SFT_API_URL": gw.url, "SFT_API_TOKEN": gw.tokens[A]}
    res = subprocess.run([sys.executable, "-m", "gateway", "models", "show", parent["fine_tuned_model"]],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert f"training    {parent['training_file']}" in res.stdout and "trainer agrees: yes" in res.stdout
    bundle = subprocess.run([sys.executable, "-m", "gateway", "models", "show", parent["fine_tuned_model"], "--json"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert json.loads(bundle.stdout)["lineage"]["spec_hash"].startswith("sha256:")
    # the reproducibility bundle: the spec it was given, whose hash is the one the trainer reported
    res = subprocess.run([sys.executable, "-m", "gateway", "models", "bundle", parent["fine_tuned_model"],
                          "-o", str(tmp_path / "bundle.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    got = json.loads((tmp_path / "bundle.json").read_text())
    assert spec_hash(parse_spec(got["spec"])) == got["spec_hash"] == got["record"]["trainer"]["spec_hash"]
    assert got["spec"]["train"]["sha256"] == got["record"]["training_file"]["sha256"]
    assert set(got["results"]) == {"adapter.tar", "eval.json", "metrics.csv"}
    res = subprocess.run([sys.executable, "-m", "gateway", "jobs", "checkpoints", parent["id"]],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and f"{parent['fine_tuned_model']}:ckpt-step-" in res.stdout, res.stderr


def _adapter(tar_bytes: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/adapter_model.safetensors"))
        data = tar.extractfile(member)
        assert data is not None
        return dict(load(data.read()))


def test_published_checkpoints_are_models_that_download_and_continue(
        gw: LiveGateway, files: dict[str, str], parent: dict[str, Any], tmp_path: Path) -> None:
    cks = gw.api("GET", f"/v1/fine_tuning/jobs/{parent['id']}/checkpoints?limit=100", A).json()["data"]
    published = sorted((c for c in cks if c["adapter_file"]), key=lambda c: c["step_number"])
    print(f"\ncheckpoints {[c['step_number'] for c in cks]}, published {[c['step_number'] for c in published]}")
    assert 2 <= len(published) <= 3                      # keep_checkpoints: the pruned ones are not models
    final = _adapter(gw.api("GET", f"/v1/files/{_result(gw, parent, 'adapter.tar')}/content", A).content)
    lineage = _model(gw, A, parent["fine_tuned_model"]).json()["lineage"]
    assert [c["step"] for c in lineage["checkpoints"]] == [c["step_number"] for c in published]
    for c in published:
        name = c["fine_tuned_model_checkpoint"]
        assert name == f"{parent['fine_tuned_model']}:ckpt-step-{c['step_number']}"
        record = _model(gw, A, name)
        assert record.status_code == 200, record.text
        ck = record.json()["lineage"]["checkpoint"]
        body = gw.api("GET", f"/v1/files/{c['adapter_file']}/content", A).content
        assert ck["sha256"] == f"sha256:{hashlib.sha256(body).hexdigest()}" and ck["adapter_file"] == c["adapter_file"]
        assert ck["eval_loss"] is not None                # eval_every_steps == checkpoint_every_steps
        tensors = _adapter(body)
        # peft's names and shapes: the tar is what the published adapter's is, at that step
        assert {k: v.shape for k, v in tensors.items()} == {k: v.shape for k, v in final.items()}
        assert _model(gw, B, name).status_code == 404     # another tenant's: no such model
    first = published[0]
    # another tenant cannot continue from it, by either name
    theirs = gw.upload(B, chat_file(tmp_path / "b.jsonl", 40, seed=34))
    for body in ({"model": first["fine_tuned_model_checkpoint"]}, {"model": MODEL, "from_checkpoint": parent["id"]}):
        r = gw.api("POST", "/v1/fine_tuning/jobs", B, json={**body, "training_file": theirs, "hyperparameters": HP})
        assert r.status_code == 404, r.text
    # OpenAI's way resolves the checkpoint (its LoRA shape is inherited, so another one is refused)
    r = gw.api("POST", "/v1/fine_tuning/jobs", A, json={"model": first["fine_tuned_model_checkpoint"],
                                                        "training_file": files["train"],
                                                        "hyperparameters": {**FAST_HP, "lora_r": 16}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "hyperparameters.lora_r", r.text
    r = gw.api("POST", "/v1/fine_tuning/jobs", A, json={"model": "other-model", "training_file": files["train"],
                                                        "from_checkpoint": f"{parent['id']}:{first['step_number']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    r = gw.api("POST", "/v1/fine_tuning/jobs", A, json={"model": MODEL, "training_file": files["train"],
                                                        "from_checkpoint": f"{parent['id']}:1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "from_checkpoint", r.text
    # Together's way: the child starts where the parent was at that step
    child = gw.create(A, files["train"], FAST_HP, validation_file=files["val"], suffix="from-ckpt",
                      from_checkpoint=f"{parent['id']}:{first['step_number']}")
    assert child["model"] == first["fine_tuned_model_checkpoint"]
    done = gw.wait(A, child["id"], terminal, 300)
    assert done["status"] == "succeeded", done["error"]
    lin = _model(gw, A, done["fine_tuned_model"]).json()["lineage"]
    at = _model(gw, A, first["fine_tuned_model_checkpoint"]).json()["lineage"]["checkpoint"]["eval_loss"]
    print(f"parent's eval at step {first['step_number']}: {at:.6f}; the child's before it trained "
          f"{lin['eval']['before']:.6f}; the parent's final {lineage['eval']['after']:.6f}")
    assert lin["parent"] == first["fine_tuned_model_checkpoint"]
    assert lin["eval"]["before"] == pytest.approx(at, rel=1e-4)
