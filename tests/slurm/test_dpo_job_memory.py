"""Issue 29, DPO on a real model in the memory it promises: a DPO job on SmolLM2-135M through the API
(60 short preference pairs, defaults, beta 0.1) succeeds inside the job's memory limit (it was killed
OUT_OF_MEMORY in its first step), at most 1.5x the peak of the supervised job on the same data size."""

from __future__ import annotations

import glob
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.slurm.livegateway import STORAGE, LiveGateway, chat_file, terminal

pytestmark = pytest.mark.slurm
TENANT, SFT_TENANT = "t-dpo-mem", "t-sft-mem"
EXAMPLES = 60
HP = {"n_epochs": 1, "max_steps": 1}   # otherwise the defaults (max_seq_len 2048, batch_size_tokens 4096);
                                       # the old code was killed in its first step


def _smollm2() -> str:
    models = json.loads((STORAGE / "models" / "index.json").read_text())["models"]
    names = [m["name"] for m in models if m["name"].startswith("smollm2")]
    if not names:
        pytest.skip("no SmolLM2 in the catalog (finetune models import-smollm2)")
    return str(names[0])


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("dpo-memory"), (TENANT, SFT_TENANT))
    yield g
    g.stop()


def _cgroup_peak(slurm_id: int) -> int | None:
    """The job cgroup's peak usage (what the memory limit is held against), while the job exists."""
    for path in glob.glob(f"/sys/fs/cgroup/memory/slurm_*/uid_*/job_{slurm_id}/memory.max_usage_in_bytes"):
        try:
            return int(Path(path).read_text())
        except (OSError, ValueError):
            return None
    return None


def _sacct(slurm_id: int) -> tuple[str, int, int]:
    """(state, the largest MaxRSS of the job's steps in bytes, the requested memory in bytes) from sacct."""
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(["sacct", "-j", str(slurm_id), "-n", "-P", "-o", "State,MaxRSS,ReqMem"],
                             capture_output=True, text=True, timeout=30).stdout
        rows = [line.split("|") for line in out.splitlines() if line]
        rss = [_bytes(r[1]) for r in rows if r[1]]
        if rows and rss or time.monotonic() > deadline:
            return rows[0][0] if rows else "", max(rss, default=0), _bytes(rows[0][2]) if rows else 0
        time.sleep(1)


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip()
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text or 0)


def _run(gw: LiveGateway, jobs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Run the jobs (tenant -> job) side by side to their ends; return each with its sacct figures
    and the cgroup's peak."""
    peak: dict[str, int | None] = dict.fromkeys(jobs)
    deadline = time.monotonic() + 600
    while not all(terminal(job) for job in jobs.values()):
        for tenant, job in jobs.items():
            assert time.monotonic() < deadline, f"job {job['id']} still {job['status']} ({job.get('phase')})"
            if not terminal(job):
                jobs[tenant] = job = gw.job(tenant, job["id"])
            if job.get("slurm_job_id") and not terminal(job):
                peak[tenant] = _cgroup_peak(int(job["slurm_job_id"])) or peak[tenant]
        time.sleep(0.5)
    done = {}
    for tenant, job in jobs.items():
        state, maxrss, limit = _sacct(int(job["slurm_job_id"]))
        done[tenant] = {**job, "sacct_state": state, "maxrss": maxrss, "limit": limit, "cgroup_peak": peak[tenant]}
    return done


def test_smollm2_dpo_job_succeeds_within_1_5x_the_supervised_jobs_memory(gw: LiveGateway,
                                                                         tmp_path: Path) -> None:
    from trainer.toydata import toy_preferences, write_jsonl

    model = _smollm2()
    pairs = gw.upload(TENANT, write_jsonl(tmp_path / "pairs.jsonl", toy_preferences(EXAMPLES, seed=1)))
    chats = gw.upload(SFT_TENANT, chat_file(tmp_path / "chat.jsonl", EXAMPLES, seed=1))
    method = {"type": "dpo", "dpo": {"hyperparameters": {**HP, "beta": 0.1}}}
    # one after the other: the host has 2 cores, side by side they only share them
    sft = _run(gw, {SFT_TENANT: gw.create(SFT_TENANT, chats, HP, model=model)})[SFT_TENANT]
    dpo = _run(gw, {TENANT: gw.create(TENANT, pairs, None, model=model, method=method,
                                      hyperparameters=None)})[TENANT]
    gib = 1 << 30
    for name, job in (("supervised", sft), ("dpo", dpo)):
        peak = f"{job['cgroup_peak'] / gib:.2f} GiB" if job["cgroup_peak"] else "-"
        print(f"\n{name} on {model}, {EXAMPLES} examples: {job['status']} ({job['sacct_state']}), sacct MaxRSS "
              f"{job['maxrss'] / gib:.2f} GiB, job cgroup peak {peak}, limit {job['limit'] / gib:.1f} GiB")
    for job in (sft, dpo):
        assert job["status"] == "succeeded" and job["sacct_state"] == "COMPLETED", (job["error"], job["sacct_state"])
        assert 0 < job["maxrss"] < job["limit"]
    assert dpo["maxrss"] <= 1.5 * sft["maxrss"]
    if dpo["cgroup_peak"] and sft["cgroup_peak"]:
        assert dpo["cgroup_peak"] <= 1.5 * sft["cgroup_peak"]
