"""SlurmClient logic against the argv-level FakeSlurm (real parsers, no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.slurm import JobScript, SlurmClient, SlurmCommandError
from gateway.slurm.client import NotOurs
from gateway.slurm.local import LocalScheduler
from gateway.slurm.records import Owner
from gateway.slurm.validate import InvalidNameError
from tests.slurmfake import FakeSlurm

ACME, BETA = Owner("sft-acme", "acme"), Owner("sft-beta", "beta")


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
    sbatch = next(c for c in fake.calls if c[0] == "sbatch")
    assert sbatch[:7] == ("sbatch", "--parsable", "--export=NONE", "--uid", "sft-acme", "--gid", "sft-acme")
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
    jid = client.submit(script(), user="sft-acme")
    fake.start(jid)
    res = client.cancel(jid, owner=ACME, deadline_s=5, poll_s=0.01)
    assert not res.escalated and res.final_state == "CANCELLED"
    assert ("scancel", "--signal=USR2", "--batch", "--user=sft-acme", "--account=acme", str(jid)) in fake.calls


def test_cancel_escalates_to_kill_after_deadline(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    jid = client.submit(script(), user="sft-acme")
    fake.start(jid)
    fake.jobs[jid].ignores_term = True
    res = client.cancel(jid, owner=ACME, deadline_s=0.05, poll_s=0.01)
    assert res.escalated and res.seconds >= 0.05
    assert ("scancel", "--signal=KILL", "--batch", "--user=sft-acme", "--account=acme", str(jid)) in fake.calls


def test_cancel_pending_job(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    jid = client.submit(script(), user="sft-acme")
    res = client.cancel(jid, owner=ACME, deadline_s=5, poll_s=0.01)
    assert res.final_state == "CANCELLED" and not res.escalated
    assert ("scancel", "--user=sft-acme", "--account=acme", str(jid)) in fake.calls


def test_sshare_records(fake: FakeSlurm) -> None:
    rows = SlurmClient(fake).sshare()
    assert {r.user for r in rows if r.account == "acme"} == {None, "sft-acme"}


@pytest.mark.parametrize("name", ["a b", "acme;id", "../etc", "$(id)", "Acme"])
def test_tenant_add_refuses_bad_name_before_any_command(fake: FakeSlurm, name: str,
                                                        tmp_path: object) -> None:
    from pathlib import Path

    from gateway.storage.onboarding import TenantAdmin

    with pytest.raises(InvalidNameError, match="invalid tenant name"):
        TenantAdmin(fake, storage_root=Path(str(tmp_path))).add_tenant(name, shares=1, qos=["ft-small"])
    assert fake.calls == []


def test_known_slurm_errors_get_a_hint() -> None:
    err = SlurmCommandError(["sbatch"], 1, "sbatch: error: QOSMaxWallDurationPerJobLimit\n"
                            "sbatch: error: Batch job submission failed: Job violates "
                            "accounting/QOS policy")
    assert "MaxWall" in err.hint and "MaxWall" in str(err)


# ---------------------------------------------------------------- ids are claims, records are checked
def test_an_id_printed_by_a_tampered_sbatch_is_not_recorded(fake: FakeSlurm) -> None:
    """sbatch runs as the tenant, who may rewrite what it prints (ptrace): here it prints the id of
    another tenant's running job. The client records the job Slurm has under its name and owner."""
    client = SlurmClient(fake)
    victim = client.submit(script("beta"), user="sft-beta")
    fake.start(victim)
    fake.sbatch_prints = victim
    jid = client.submit(script(), user="sft-acme")
    assert jid != victim and fake.jobs[jid].user == "sft-acme" and fake.jobs[jid].name == "job"


def test_a_claim_that_matches_nothing_of_the_tenant_is_refused(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    victim = client.submit(script("beta"), user="sft-beta")
    fake.jobs[victim].name = "job"     # even a victim job of the very same name is not taken
    fake.sbatch_prints = victim

    def rename(j):  # type: ignore[no-untyped-def]
        j.name = "renamed"             # the tenant renames its new job at once: nothing to confirm
    fake.on_sbatch = rename
    with pytest.raises(SlurmCommandError, match="Slurm shows 0 such jobs.*submission refused"):
        client.submit(script(), user="sft-acme")

    def twin(j):  # type: ignore[no-untyped-def]
        fake.jobs[j.job_id + 100] = type(j)(j.job_id + 100, j.name, j.user, j.account, j.qos)
    fake.on_sbatch = twin              # two new jobs of the tenant under the name: neither is trusted
    with pytest.raises(SlurmCommandError, match="Slurm shows 2 such jobs"):
        client.submit(script(), user="sft-acme")
    mine = [j for j in fake.jobs.values() if j.user == "sft-acme" and j.name == "job"]
    assert len(mine) == 2 and all(j.state == "CANCELLED" for j in mine)
    assert fake.jobs[victim].state == "PENDING"
    assert not any(c[0] == "scancel" and c[-1] == str(victim) for c in fake.calls)


def test_an_old_job_of_the_tenant_under_the_name_is_not_taken_for_the_new_one(fake: FakeSlurm) -> None:
    from datetime import UTC, datetime, timedelta

    client = SlurmClient(fake)
    old = client.submit(script(), user="sft-acme")
    fake.jobs[old].submit = datetime.now(UTC) - timedelta(hours=1)
    fake.sbatch_prints = old
    new = client.submit(script(), user="sft-acme")
    assert new != old


def test_cancel_pause_release_requeue_refuse_another_owners_job(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    victim = client.submit(script("beta"), user="sft-beta")
    fake.start(victim)
    before = len(fake.calls)
    for act in (lambda: client.cancel(victim, owner=ACME, deadline_s=1),
                lambda: client.pause(victim, owner=ACME), lambda: client.release(victim, owner=ACME),
                lambda: client.requeue(victim, owner=ACME)):
        with pytest.raises(NotOurs, match="not acme's job"):
            act()
    assert {c[0] for c in fake.calls[before:]} == {"squeue"} and fake.jobs[victim].state == "RUNNING"


def test_scancel_carries_the_owner_so_slurm_itself_leaves_another_job_alone(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    victim = client.submit(script("beta"), user="sft-beta")
    client.cancel_array(victim, owner=ACME)
    assert fake.calls[-1] == ("scancel", "--user=sft-acme", "--account=acme", str(victim))
    assert fake.jobs[victim].state == "PENDING"


def test_a_duplicate_record_makes_that_job_invalid_and_no_other(fake: FakeSlurm) -> None:
    """A forged line (as a job name with a line break once made) repeats another job's id: neither
    record of that id is trusted, the other jobs read as usual, and nothing reads as ended."""
    client = SlurmClient(fake)
    a, b = (client.submit(script(), user="sft-acme") for _ in range(2))
    fake.start(a)
    real = fake.run
    def doubled(argv, **kw):  # type: ignore[no-untyped-def]
        res = real(argv, **kw)
        if argv[0] == "squeue" and res.stdout:
            line = next(x for x in res.stdout.splitlines() if x.startswith(f"{a}\x1f"))
            return type(res)(res.argv, res.returncode, res.stdout + line.replace("RUNNING", "CANCELLED") + "\n",
                             res.stderr, res.seconds)
        return res
    fake.run = doubled  # type: ignore[method-assign]
    st = client.states([a, b])
    assert st[a].source == "invalid" and st[a].active and st[a].owner_problem(ACME)
    assert st[b].source == "squeue" and st[b].owner_problem(ACME) is None


# ------------------------------------------------------------------ arrays (the Scheduler protocol's)
def task_scripts(n: int, account: str = "acme") -> list[JobScript]:
    """``n`` array tasks as a sweep makes them: sibling job dirs named after their jobs."""
    return [JobScript(f"ftjob-{i}", account, "ft-standard", f"/srv/t/jobs/ftjob-{i}", ("/bin/true",))
            for i in range(n)]


def test_a_named_array_is_submitted_held_each_task_named_then_released(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    array, ids = client.submit_named_array(task_scripts(3), name="ftsweep-1", task_names=["a", "b", "c"],
                                           user="sft-acme")
    tasks = sorted((j for j in fake.jobs.values() if j.array_id == array), key=lambda j: j.task or 0)
    assert [j.name for j in tasks] == ["a", "b", "c"] and not any(j.held for j in tasks)
    assert ids == [j.job_id for j in tasks] and len(set(ids)) == 3
    assert [c[:2] for c in fake.calls if c[0] == "scontrol"] == [("scontrol", "update")] * 3 + \
        [("scontrol", "release")] * 3          # every task named before any is released
    assert fake.count("sbatch") == 1


def test_a_failure_after_sbatch_cancels_the_whole_array_before_raising(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    fake.fail_next["scontrol"] = (1, "slurm_update error: Access/permission denied")
    with pytest.raises(SlurmCommandError, match="permission denied"):
        client.submit_named_array(task_scripts(3), name="ftsweep-1", task_names=["a", "b", "c"], user="sft-acme")
    assert {j.state for j in fake.jobs.values()} == {"CANCELLED"}       # no task runs unrecorded
    assert fake.calls[-1][0] == "scancel" and "--user=sft-acme" in fake.calls[-1]


def test_an_array_showing_other_tasks_than_submitted_is_cancelled(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    fake.on_sbatch = lambda j: fake.age_out(j.job_id + 2)     # task 2 gone from the queue at once
    with pytest.raises(SlurmCommandError, match="shows tasks"):
        client.submit_named_array(task_scripts(3), name="ftsweep-1", task_names=["a", "b", "c"], user="sft-acme")
    assert {j.state for j in fake.jobs.values()} == {"CANCELLED"}


def test_cancel_unnamed_tasks_cancels_only_the_owners_never_named_tasks(fake: FakeSlurm) -> None:
    """A gateway that died between sbatch and naming: task 0 named (adopted as its job), tasks 1-2 still
    carry the array's name (held, never ran): those two are cancelled; another tenant's array under the
    same name is left alone."""
    client = SlurmClient(fake)
    ours = client.submit_array(task_scripts(3), name="ftsweep-1", user="sft-acme")
    client.name_task(ours, 0, "ftjob-0")
    theirs = client.submit_array(task_scripts(2, "beta"), name="ftsweep-1", user="sft-beta")
    assert client.cancel_unnamed_tasks({"ftsweep-1": ACME}) == [("ftsweep-1", 1, ours), ("ftsweep-1", 2, ours)]
    state = {(j.array_id, j.task): j.state for j in fake.jobs.values()}
    assert state == {(ours, 0): "PENDING", (ours, 1): "CANCELLED", (ours, 2): "CANCELLED",
                     (theirs, 0): "PENDING", (theirs, 1): "PENDING"}
    assert client.cancel_unnamed_tasks({}) == []


def test_ping_is_whether_slurmctld_answers(fake: FakeSlurm) -> None:
    client = SlurmClient(fake)
    assert client.ping() and fake.calls[-1] == ("scontrol", "ping")
    fake.fail_next["scontrol"] = (1, "slurm_ping error: Unable to contact slurm controller")
    assert not client.ping()


def test_local_mode_has_no_arrays_and_no_queue(tmp_path: Path) -> None:
    """What the Scheduler protocol answers in local mode, so no caller asks which scheduler it has."""
    local = LocalScheduler(Settings(storage_root=tmp_path / "s", state_dir=tmp_path / "state", backend="local"))
    with pytest.raises(ServiceError) as e:
        local.submit_named_array(task_scripts(2), name="ftsweep-1", task_names=["a", "b"])
    assert e.value.code == "no_backend"
    assert local.cancel_unnamed_tasks({"ftsweep-1": ACME}) == [] and local.pending_starts([1, 2]) == {}
    assert local.running_gpus("acme") == [] and local.test_only(task_scripts(1)[0])[1] == "local"
