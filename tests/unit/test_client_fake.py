"""SlurmClient logic against the argv-level FakeSlurm (real parsers, no cluster)."""

from __future__ import annotations

import pytest

from gateway.slurm import JobScript, SlurmClient, SlurmCommandError
from gateway.slurm.fake import FakeSlurm
from gateway.slurm.validate import InvalidNameError


def script(account: str = "acme") -> JobScript:
    return JobScript("job", account, "ft-standard", "/srv/t/jobs/x", ("/bin/true",))


@pytest.fixture
def fake() -> FakeSlurm:
    return FakeSlurm()


def test_states_for_20_jobs_is_one_squeue_and_one_sacct(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    ids = [client.submit(script(), user="sft-acme") for _ in range(20)]
    for j in ids[:5]:
        fake.start(j)
    for j in ids[5:8]:
        fake.finish(j)
        fake.age_out(j)
    fake.calls.clear()
    states = client.states(ids)
    assert (fake.count("squeue"), fake.count("sacct")) == (1, 1)
    assert {states[j].state for j in ids[:5]} == {"RUNNING"}
    assert all(states[j].source == "sacct" and not states[j].active for j in ids[5:8])
    assert {states[j].state for j in ids[8:]} == {"PENDING"}


def test_states_needs_no_sacct_when_all_in_queue(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    ids = [client.submit(script()) for _ in range(3)]
    fake.calls.clear()
    client.states(ids)
    assert (fake.count("squeue"), fake.count("sacct")) == (1, 0)


def test_a_failed_job_still_in_squeue_gets_its_exit_code_from_sacct(fake: FakeSlurm) -> None:
    """squeue keeps an ended job a while, without its exit code: the trainer's user error (65) must not
    read as an internal failure (the landing CI of stop 25 showed a diverged run labelled ``internal``)."""
    client = SlurmClient(fake)
    failed, done = client.submit(script()), client.submit(script())
    fake.finish(failed, state="FAILED", exit="65:0")
    fake.finish(done)
    fake.calls.clear()
    states = client.states([failed, done])
    assert (fake.count("squeue"), fake.count("sacct")) == (1, 1)
    assert states[failed].source == "squeue" and states[failed].acct is not None
    assert states[failed].acct.exit[0] == 65 and states[done].acct is None


def test_unknown_job_is_missing_not_failed(fake: FakeSlurm) -> None:
    status = SlurmClient(fake).states([424242])[424242]
    assert status.source == "missing" and status.active and status.state is None


def test_submit_passes_uid_and_script(fake: FakeSlurm) -> None:
    jid = SlurmClient(fake).submit(script(), user="sft-acme")
    assert fake.calls[-1][:7] == ("sbatch", "--parsable", "--export=NONE", "--uid", "sft-acme", "--gid", "sft-acme")
    assert "#SBATCH --account=acme" in fake.jobs[jid].script


def test_sbatch_error_carries_slurm_text(fake: FakeSlurm) -> None:
    with pytest.raises(SlurmCommandError) as e:
        SlurmClient(fake).submit(script(account="other"), user="sft-acme")
    assert "Invalid account or account/partition combination specified" in e.value.message


def test_bad_user_refused_before_any_command(fake: FakeSlurm) -> None:
    with pytest.raises(InvalidNameError):
        SlurmClient(fake).submit(script(), user="root;id")
    assert fake.calls == []


def test_failed_query_raises_and_changes_nothing(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    jid = client.submit(script())
    fake.fail_next["squeue"] = (1, "slurm_load_jobs error: Unable to contact slurm controller")
    with pytest.raises(SlurmCommandError, match="Unable to contact"):
        client.states([jid])
    assert fake.jobs[jid].state == "PENDING"


def test_cancel_polite_job_needs_no_kill(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    jid = client.submit(script())
    fake.start(jid)
    res = client.cancel(jid, deadline_s=5, poll_s=0.01)
    assert not res.escalated and res.final_state == "CANCELLED"
    assert ("scancel", "--signal=USR2", "--batch", str(jid)) in fake.calls


def test_cancel_escalates_to_kill_after_deadline(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    jid = client.submit(script())
    fake.start(jid)
    fake.jobs[jid].ignores_term = True
    res = client.cancel(jid, deadline_s=0.05, poll_s=0.01)
    assert res.escalated and res.seconds >= 0.05
    assert ("scancel", "--signal=KILL", "--batch", str(jid)) in fake.calls


def test_cancel_pending_job(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    jid = client.submit(script())
    res = client.cancel(jid, deadline_s=5, poll_s=0.01)
    assert res.final_state == "CANCELLED" and not res.escalated
    assert ("scancel", str(jid)) in fake.calls


def test_sshare_records(fake: FakeSlurm) -> None:
    rows = SlurmClient(fake).sshare()
    assert {r.user for r in rows if r.account == "acme"} == {None, "sft-acme"}


@pytest.mark.parametrize("name", ["a b", "acme;id", "../etc", "$(id)", "Acme"])
def test_tenant_add_refuses_bad_name_before_any_command(fake: FakeSlurm, name: str,
                                                        tmp_path: object) -> None:
    from pathlib import Path

    from gateway.slurm.admin import Admin

    with pytest.raises(InvalidNameError, match="invalid tenant name"):
        Admin(fake, storage_root=Path(str(tmp_path))).add_tenant(name, shares=1, qos=["ft-small"])
    assert fake.calls == []


def test_known_slurm_errors_get_a_hint() -> None:
    err = SlurmCommandError(["sbatch"], 1, "sbatch: error: QOSMaxWallDurationPerJobLimit\n"
                            "sbatch: error: Batch job submission failed: Job violates "
                            "accounting/QOS policy")
    assert "MaxWall" in err.hint and "MaxWall" in str(err)
