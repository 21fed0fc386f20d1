"""A tenant job on the real cluster: identity, one GPU, QOS limits, bad submissions."""

from __future__ import annotations

import json

import pytest

from gateway.slurm import SlurmClient, SlurmCommandError
from gateway.slurm.records import Owner
from tests.slurm.conftest import accounting, finished, submit, wait_for, wait_output

pytestmark = pytest.mark.slurm

DEVICE_PROBE = r"""
import errno, json, os
node = os.environ["SLURMD_NODENAME"]
first = 0 if node.endswith("-n1") else 4
res = {}
for i in range(first, first + 4):
    try:
        os.close(os.open(f"/dev/nvidia{i}", os.O_RDWR))
        res[i] = "open"
    except OSError as e:
        res[i] = errno.errorcode[e.errno]
print(json.dumps({"devices": res, "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "job_gpus": os.environ.get("SLURM_JOB_GPUS"), "user": os.getuid()}))
"""


def test_job_runs_as_tenant_and_sees_exactly_one_gpu(client: SlurmClient,
                                                     tenants: tuple[str, str]) -> None:
    a, _ = tenants
    jid, d = submit(client, a, DEVICE_PROBE, interpreter="/usr/bin/python3")
    st = wait_for(client, jid, finished)
    assert st.state == "COMPLETED", (d / f"slurm-{jid}.out").read_text()
    out = json.loads((d / f"slurm-{jid}.out").read_text().strip().splitlines()[-1])
    assert out["cvd"] == "0", "the job sees its one GPU renumbered as device 0"
    # ENXIO: allowed by the cgroup but no driver behind the fake device; EPERM: denied.
    allowed = [i for i, r in out["devices"].items() if r != "EPERM"]
    assert allowed == [out["job_gpus"]], out
    acct = accounting(client, jid)
    assert (acct.account, acct.qos, acct.user) == (a, "ft-standard", f"sft-{a}")
    assert "gres/gpu=1" in acct.alloc_tres and acct.gpus == 1


def test_qos_gpu_limit_holds_third_job_while_other_tenant_runs(
        client: SlurmClient, tenants: tuple[str, str]) -> None:
    a, b = tenants
    ids = [submit(client, a, "sleep 60")[0] for _ in range(3)]
    try:
        wait_for(client, ids[1], lambda s: s.state == "RUNNING", 30)
        wait_for(client, ids[0], lambda s: s.state == "RUNNING", 30)
        third = wait_for(client, ids[2], lambda s: s.reason == "QOSMaxGRESPerUser", 30)
        assert third.state == "PENDING"
        other, _ = submit(client, b, "sleep 1")
        wait_for(client, other, lambda s: s.state in ("RUNNING", "COMPLETED"), 30)
        assert client.states([ids[2]])[ids[2]].reason == "QOSMaxGRESPerUser"
    finally:
        for j in ids:
            client.cancel(j, owner=Owner(f"sft-{a}", a), deadline_s=5)


def test_job_past_max_wall_is_refused_with_slurms_reason(client: SlurmClient,
                                                        tenants: tuple[str, str]) -> None:
    a, _ = tenants
    with pytest.raises(SlurmCommandError) as e:
        submit(client, a, "true", qos="ft-small", minutes=5 * 60)  # ft-small MaxWall 4h
    assert "QOS" in e.value.message or "time limit" in e.value.message, e.value.message
    assert "MaxWall" in e.value.hint


def test_submitting_under_another_tenants_account_is_refused(client: SlurmClient,
                                                            tenants: tuple[str, str]) -> None:
    a, b = tenants
    with pytest.raises(SlurmCommandError) as e:
        submit(client, a, "true", account=b)
    assert "Invalid account or account/partition combination specified" in e.value.message


def test_states_of_20_jobs_is_one_squeue_and_at_most_one_sacct(
        client: SlurmClient, calls: list[tuple[str, ...]], tenants: tuple[str, str]) -> None:
    a, b = tenants
    done = [submit(client, b, "true")[0] for _ in range(2)]
    for j in done:
        wait_for(client, j, finished)
    ids = done + [submit(client, a, "sleep 30")[0] for _ in range(18)]
    try:
        calls.clear()
        states = client.states(ids)
        assert [c[0] for c in calls].count("squeue") == 1
        assert [c[0] for c in calls].count("sacct") <= 1
        assert len(calls) <= 2 and set(states) == set(ids)
        assert all(states[j].state == "COMPLETED" for j in done)
        assert all(states[j].state in ("PENDING", "RUNNING") for j in ids[2:])
    finally:
        for j in ids[2:]:
            client.cancel(j, owner=Owner(f"sft-{a}", a), deadline_s=5)


def test_cancel_term_ignoring_job_within_deadline(client: SlurmClient,
                                                  tenants: tuple[str, str]) -> None:
    a, _ = tenants
    jid, d = submit(client, a, "trap '' TERM; echo started; while true; do sleep 0.2; done")
    wait_output(d / f"slurm-{jid}.out", "started")
    res = client.cancel(jid, owner=Owner(f"sft-{a}", a), deadline_s=3)
    print(f"\ncancel of a SIGTERM-ignoring job: {res.seconds:.2f}s "
          f"(deadline 3s, escalated={res.escalated}, final {res.final_state})")
    assert res.escalated and res.seconds < 3 + 5, "KILL must end it well before KillWait (30s)"
    assert not client.states([jid])[jid].active


def test_a_trainer_slower_than_the_cancel_is_killed_by_its_script_and_recorded_cancelled(
        client: SlurmClient, tenants: tuple[str, str]) -> None:
    """Issue 35: a gateway cancel of a trainer that does not stop in time (a long step) once needed the
    gateway's KILL to the batch step, which Slurm records FAILED 0:9 (the usage report counted it a
    failure). The batch script now kills its trainer itself after ``cancel_grace_s`` and cancels the
    job, under the gateway's deadline: CANCELLED in sacct, no escalation."""
    a, _ = tenants
    jid, d = submit(client, a, "trap '' TERM; echo started; while true; do sleep 0.2; done", cancel_grace_s=2)
    wait_output(d / f"slurm-{jid}.out", "started")
    res = client.cancel(jid, owner=Owner(f"sft-{a}", a), deadline_s=8)
    print(f"\ncancel of a trainer slower than the cancel: {res.seconds:.2f}s (script's grace 2s, gateway's "
          f"deadline 8s, escalated={res.escalated})")
    assert not res.escalated and res.seconds < 8
    acct = accounting(client, jid)
    print(f"sacct: {acct.state} {acct.exit}")
    assert acct.state == "CANCELLED"


def test_cancel_polite_job_is_recorded_cancelled(client: SlurmClient,
                                                 tenants: tuple[str, str]) -> None:
    a, _ = tenants
    jid, d = submit(client, a, "echo started; sleep 120")
    wait_output(d / f"slurm-{jid}.out", "started")
    res = client.cancel(jid, owner=Owner(f"sft-{a}", a), deadline_s=10)
    print(f"\ncancel of a polite job: {res.seconds:.2f}s")
    assert not res.escalated and res.seconds < 5
    assert wait_for(client, jid, finished).state == "CANCELLED"


def test_requeue_that_slurm_refuses_ends_the_job_at_once(client: SlurmClient,
                                                         tenants: tuple[str, str]) -> None:
    """Exit 75 asks for a requeue; when scontrol cannot requeue (here: --no-requeue), the
    batch script ends with the trainer's code instead of holding its GPU to the time limit."""
    a, _ = tenants
    jid, d = submit(client, a, "echo started; exit 75", requeue=False)
    st = wait_for(client, jid, finished, timeout=60)
    out = (d / f"slurm-{jid}.out").read_text()
    assert "requeue requested (exit 75)" in out, out
    assert st.state == "FAILED", (st, out)
    acct = accounting(client, jid)
    assert acct.exit == (75, 0) and (acct.elapsed_s or 0) < 30, acct
