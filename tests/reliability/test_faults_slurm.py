"""Slurm daemons failing under running jobs: slurmctld restarted, slurmdbd down for a while,
a compute node lost mid-training (slurmd and the job's processes killed, as in a crash).
The dev cluster is always put back (`finetune dev-cluster up`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.conftest import cluster_up, daemon_pid, kill_daemon, scancel_tenants
from tests.reliability.faultlib import assert_consistent, checkpoints_complete, trainer_events
from tests.slurm.livegateway import FAST_HP, STORAGE, LiveGateway, chat_file, terminal

pytestmark = [pytest.mark.slurm, pytest.mark.heavy]
T = "t-rel-s"
SLOW_HP = {**FAST_HP, "n_epochs": 4, "batch_size_tokens": 256, "checkpoint_every_steps": 2, "max_steps": 14}


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("slurmfault"), (T,))
    yield g
    g.stop()
    scancel_tenants(T)


@pytest.fixture(scope="module")
def data(gw: LiveGateway, tmp_path_factory: pytest.TempPathFactory) -> str:
    return gw.upload(T, chat_file(tmp_path_factory.mktemp("d") / "s.jsonl", 80, seed=11))


def _since() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _history(gw: LiveGateway, job_id: str) -> list[str]:
    events = gw.api("GET", f"/v1/fine_tuning/jobs/{job_id}/events?limit=1000", T).json()["data"]
    return [e["message"] for e in reversed(events)]


def test_slurmctld_restart_while_a_job_trains(gw: LiveGateway, data: str, restore_cluster: None) -> None:
    since = _since()
    job = gw.create(T, data, SLOW_HP)
    gw.wait(T, job["id"], lambda j: (j["progress"].get("step") or 0) >= 2 or terminal(j), 300)
    kill_daemon("slurmctld", signal.SIGTERM)
    try:
        seen = []
        for _ in range(8):                    # ~8 s without a controller: nothing may change state
            seen.append(gw.job(T, job["id"])["status"])
            time.sleep(1)
        assert set(seen) <= {"running", "queued"}, seen
    finally:
        cluster_up()
    done = gw.wait(T, job["id"], terminal, 400)
    assert done["status"] == "succeeded", done["error"]
    assert_consistent(gw, T, since, {job["id"]: "succeeded"})


def test_slurmdbd_down_while_jobs_run_and_finish(gw: LiveGateway, data: str, restore_cluster: None) -> None:
    since = _since()
    job = gw.create(T, data, FAST_HP)
    gw.wait(T, job["id"], lambda j: j["status"] == "running" or terminal(j), 300)
    kill_daemon("slurmdbd", signal.SIGTERM)
    seen: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 40          # the job finishes while accounting is down
        while time.monotonic() < deadline:
            j = gw.job(T, job["id"])
            seen.append(j)
            assert j["status"] != "failed", j["error"]
            if terminal(j):
                break
            time.sleep(1)
    finally:
        cluster_up()
    done = gw.wait(T, job["id"], terminal, 300)
    during = sorted({s["status"] for s in seen})
    print(f"\nslurmdbd down: job status during the outage {during}, final {done['status']}")
    assert done["status"] == "succeeded", done["error"]
    assert_consistent(gw, T, since, {job["id"]: "succeeded"})


def _procs_of_job(slurm_id: int) -> list[int]:
    """PIDs of the job's slurmstepd and everything under it (what dies with a node)."""
    steps = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmd(p).startswith(
        f"slurmstepd: [{slurm_id}.")]
    out = set(steps)
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            pid = int(p.name)
            if any(a in steps for a in _ancestors(pid)):
                out.add(pid)
    return sorted(out)


def _cmd(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ancestors(pid: int) -> list[int]:
    out = []
    for _ in range(20):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            break
        out.append(pid)
    return out


def _node_alone(slurm_id: int, node: str) -> bool:
    res = subprocess.run(["squeue", "-h", "-w", node, "-t", "R", "-o", "%i"], capture_output=True, text=True)
    return res.stdout.split() == [str(slurm_id)]


def test_node_lost_mid_training_requeues_and_resumes_from_checkpoint(gw: LiveGateway, data: str,
                                                                      restore_cluster: None) -> None:
    since = _since()
    job = gw.create(T, data, {**SLOW_HP, "max_steps": 40})     # long enough to be lost mid-training
    jid = job["id"]
    running = gw.wait(T, jid, lambda j: (j["progress"].get("step") or 0) >= 4 or terminal(j), 300)
    assert running["status"] == "running", running
    node = subprocess.run(["squeue", "-h", "-j", str(running["slurm_job_id"]), "-o", "%N"], capture_output=True,
                          text=True).stdout.strip()
    deadline = time.monotonic() + 60
    while not _node_alone(running["slurm_job_id"], node):   # never take other tests' jobs down with it
        if time.monotonic() > deadline:
            pytest.skip(f"node {node} is shared with other running jobs: a node failure would hit them")
        time.sleep(1)
    step_before = gw.job(T, jid)["progress"].get("step")
    victims = _procs_of_job(running["slurm_job_id"])
    assert victims, "no slurmstepd found for the job"
    slurmd = daemon_pid(f"slurmd-{node}")
    t0 = time.monotonic()
    try:
        for pid in [slurmd, *victims]:       # the node "crashes": its slurmd and the job's processes die
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # slurmctld declares a silent node DOWN after SlurmdTimeout (300 s by default): do now what it does then
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=reliability test: node lost"],
                       check=True)
        for _ in range(30):                   # Slurm requeues (or fails) the job: the gateway follows
            if gw.job(T, jid)["status"] != "running":
                break
            time.sleep(1)
    finally:
        cluster_up()                          # the node "reboots": slurmd registers again
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
    done = gw.wait(T, jid, terminal, 600)
    took = time.monotonic() - t0
    history = _history(gw, jid)
    sacct = subprocess.run(["sacct", "-n", "-X", "-P", "-D", "-j", str(running["slurm_job_id"]),
                            "-o", "State,ExitCode"],
                           capture_output=True, text=True).stdout.split()
    print(f"\nnode lost at step {step_before}: Slurm says {sacct}; gateway {done['status']} "
          f"({(done['error'] or {}).get('code')}) after {took:.0f}s; attempt {done['attempt']}")
    jdir = STORAGE / "tenants" / T / "jobs" / jid
    assert checkpoints_complete(jdir) == []
    if done["status"] == "succeeded":
        # requeued by Slurm (NODE_FAIL + --requeue): the next attempt resumed from a checkpoint
        assert done["attempt"] >= 1 and any("requeued" in m or m.startswith("Attempt 1") for m in history), history
        starts = [e for e in trainer_events(jdir) if e["type"] == "start" and e.get("attempt", 0) >= 1]
        assert any((e.get("resumed_from_step") or 0) > 0 for e in starts), starts
        assert_consistent(gw, T, since, {jid: "succeeded"})
    else:
        assert done["status"] == "failed" and done["error"]["code"] == "node_fail", done
        assert_consistent(gw, T, since, {jid: "failed"})
