"""A 2x2 hyperparameter sweep on the real cluster: one request, four jobs, ONE Slurm job array
(sacct shows every run as a task of it), each run an ordinary job with its own directory, and
a comparison that names the best run by validation loss; another tenant sees none of it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.slurm.livegateway import FAST_HP, MODEL, STORAGE, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
A, B = "t-sweep-a", "t-sweep-b"
ROOT = Path(__file__).resolve().parents[2]
SHARED = {k: v for k, v in FAST_HP.items() if k != "learning_rate_multiplier"}
GRID = {"learning_rate_multiplier": [1, 20], "lora_r": [4, 8]}


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("sweep"), (A, B))
    yield g
    g.stop()


@pytest.fixture(scope="module")
def files(gw: LiveGateway, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("d")
    return {"train": gw.upload(A, chat_file(d / "train.jsonl", 60, seed=51)),
            "val": gw.upload(A, chat_file(d / "val.jsonl", 20, seed=52))}


@pytest.fixture(scope="module")
def sweep(gw: LiveGateway, files: dict[str, str]) -> dict[str, Any]:
    r = gw.api("POST", "/v1/fine_tuning/sweeps", A, json={
        "model": MODEL, "training_file": files["train"], "validation_file": files["val"], "grid": GRID,
        "hyperparameters": SHARED, "suffix": "sw", "seed": 3})
    assert r.status_code == 200, r.text
    created = r.json()
    for run in created["runs"]:
        done = gw.wait(A, run["job_id"], terminal, 300)
        assert done["status"] == "succeeded", done["error"]
    return dict(gw.api("GET", f"/v1/fine_tuning/sweeps/{created['id']}", A).json())


def test_the_grid_runs_as_one_slurm_array(gw: LiveGateway, sweep: dict[str, Any]) -> None:
    runs, array = sweep["runs"], sweep["slurm_array_id"]
    assert isinstance(array, int) and len(runs) == 4
    assert [r["hyperparameters"] for r in runs] == [{"learning_rate_multiplier": lr, "lora_r": r}
                                                    for lr in GRID["learning_rate_multiplier"] for r in GRID["lora_r"]]
    res = subprocess.run(["sacct", "-X", "-n", "-P", f"--jobs={array}",
                          "--format=JobID,JobIDRaw,JobName,State,Account"],
                         capture_output=True, text=True, timeout=30, check=True)
    rows = [line.split("|") for line in res.stdout.splitlines() if line.strip()]
    print(f"\nsacct -j {array}:\n" + res.stdout)
    by_task = {int(jid.split("_")[1]): (int(raw), name, state, acct) for jid, raw, name, state, acct in rows
               if jid.startswith(f"{array}_")}
    assert sorted(by_task) == [0, 1, 2, 3], rows
    for r in runs:
        raw, name, state, acct = by_task[r["task"]]
        assert (raw, name, state, acct) == (r["slurm_job_id"], r["job_id"], "COMPLETED", A)
        job = gw.job(A, r["job_id"])
        assert job["hyperparameters"]["n_epochs"] == 1
        # the task's output went to its own job's directory
        assert (STORAGE / "tenants" / A / "jobs" / r["job_id"] / f"slurm-{raw}.out").is_file()


def test_the_comparison_names_the_best_run_by_validation_loss(gw: LiveGateway, sweep: dict[str, Any]) -> None:
    losses = {}
    for r in sweep["runs"]:
        lineage = gw.api("GET", f"/v1/models/{r['fine_tuned_model']}", A).json()["lineage"]
        assert lineage["hyperparameters"]["lora_r"] == r["hyperparameters"]["lora_r"]
        losses[r["job_id"]] = lineage["eval"]["after"]
        assert r["valid_loss"] == pytest.approx(losses[r["job_id"]])
        assert r["eval_curve"] and r["eval_curve"][-1][1] == pytest.approx(losses[r["job_id"]])
    best = min(losses, key=lambda j: losses[j])
    print("valid losses:", {j[-6:]: round(v, 5) for j, v in losses.items()}, "best", best[-6:])
    assert len(set(losses.values())) == 4, "the grid points trained differently"
    assert sweep["status"] == "succeeded" and sweep["best"]["job_id"] == best
    env = {**gw.env, "SFT_API_URL": gw.url, "SFT_API_TOKEN": gw.tokens[A]}
    res = subprocess.run([sys.executable, "-m", "gateway", "sweeps", "show", sweep["id"]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    marked = [line for line in res.stdout.splitlines() if line.endswith("<- best")]
    assert len(marked) == 1 and best in marked[0], res.stdout
    assert f"finetune models promote {sweep['best']['fine_tuned_model']}" in res.stdout
    listed = json.loads(subprocess.run([sys.executable, "-m", "gateway", "sweeps", "list", "--json"], cwd=ROOT,
                                       env=env, capture_output=True, text=True, timeout=60).stdout)["data"]
    assert [s["id"] for s in listed] == [sweep["id"]]


def test_another_tenant_sees_no_sweep(gw: LiveGateway, sweep: dict[str, Any]) -> None:
    assert gw.api("GET", f"/v1/fine_tuning/sweeps/{sweep['id']}", B).status_code == 404
    assert gw.api("POST", f"/v1/fine_tuning/sweeps/{sweep['id']}/cancel", B).status_code == 404
    assert gw.api("GET", "/v1/fine_tuning/sweeps", B).json()["data"] == []


@pytest.mark.parametrize("change,param", [
    ({"grid": {"training_file": [1, 2]}}, "grid.training_file"),
    ({"grid": {"lora_r": [4, 4]}}, "grid.lora_r"),
    ({"grid": {"lora_r": [1, 2, 3, 4, 5], "n_epochs": [1, 2, 3, 4]}}, "grid"),          # 20 > 16 runs
    ({"hyperparameters": {"lora_r": 4}}, "hyperparameters.lora_r"),                    # also in the grid
])
def test_a_bad_grid_is_refused_before_anything_runs(gw: LiveGateway, files: dict[str, str],
                                                    change: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "training_file": files["train"], "validation_file": files["val"],
            "grid": {"lora_r": [4, 8]}, **change}
    before = len(gw.api("GET", "/v1/fine_tuning/jobs?limit=100", A).json()["data"])
    r = gw.api("POST", "/v1/fine_tuning/sweeps", A, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text   # a key: grid.KEY.[key]
    assert len(gw.api("GET", "/v1/fine_tuning/jobs?limit=100", A).json()["data"]) == before


def test_the_portal_compares_the_runs_to_their_tenant_only(gw: LiveGateway, sweep: dict[str, Any]) -> None:
    import httpx

    from tests.service.test_portal_session import sign_in

    with httpx.Client(base_url=gw.url, timeout=30) as mine, httpx.Client(base_url=gw.url, timeout=30) as theirs:
        sign_in(mine, gw.tokens[A])
        page = mine.get(f"/portal/sweeps/{sweep['id']}")
        assert page.status_code == 200, page.text[:300]
        assert page.text.count("<polyline") == 4 and page.text.count('class="best"') == 1
        assert f'<a class="mono" href="/portal/models/{sweep["best"]["fine_tuned_model"]}">' in page.text
        assert sweep["id"] in mine.get("/portal/sweeps").text
        sign_in(theirs, gw.tokens[B])
        assert theirs.get(f"/portal/sweeps/{sweep['id']}").status_code == 404
        assert sweep["id"] not in theirs.get("/portal/sweeps").text
