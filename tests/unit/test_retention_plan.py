"""The retention sweeper's decisions (pure: ``services.retention.plan`` and its parts), the policy's
parsing, and the broker's ``remove`` saying how many bytes it freed."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gateway.errors import ServiceError
from gateway.services.retention import (
    FileFacts,
    JobFacts,
    Task,
    file_kind,
    job_tasks,
    parse_days,
    plan,
    policy_of,
)
from gateway.storage import layout
from gateway.storage.broker import run_verb

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)
JOB = "ftjob-" + "a" * 24


def dataset(fid: str, tenant: str = "acme", age: timedelta = DAY, expires_in: timedelta | None = None) -> FileFacts:
    return FileFacts(fid, tenant, "datasets", NOW - age, NOW + expires_in if expires_in is not None else None)


def ended(jid: str, status: str = "failed", age: timedelta = DAY, done: frozenset[str] = frozenset(),
          tenant: str = "acme") -> JobFacts:
    return JobFacts(jid, tenant, status, NOW - age, done)


def test_an_expired_file_goes_and_one_not_yet_expired_stays() -> None:
    files = [dataset("file-old", expires_in=-timedelta(seconds=1)), dataset("file-now", expires_in=timedelta(0)),
             dataset("file-later", expires_in=timedelta(seconds=1)), dataset("file-never")]
    p = plan(files, [], {}, set(), NOW, limit=100)
    assert [(t.id, t.reason) for t in p.tasks] == [("file-old", "expired"), ("file-now", "expired")]
    assert p.held == []


def test_a_file_a_job_that_has_not_ended_uses_is_held_not_deleted() -> None:
    files = [dataset("file-used", expires_in=-DAY), dataset("file-free", expires_in=-DAY)]
    p = plan(files, [], {}, {"file-used"}, NOW, limit=100)
    assert [t.id for t in p.tasks] == ["file-free"]
    assert [t.id for t in p.held] == ["file-used"]
    # the job ended: no longer in use, it goes on the next pass
    assert [t.id for t in plan(files, [], {}, set(), NOW, limit=100).tasks] == ["file-used", "file-free"]


def test_the_policy_ages_out_each_kind_by_its_own_days() -> None:
    policies = {"acme": {"datasets": 30, "results": 90, "checkpoints": 7, "logs": 14}}
    files = [dataset("file-d29", age=29 * DAY), dataset("file-d30", age=30 * DAY),
             FileFacts("file-r60", "acme", "results", NOW - 60 * DAY),
             FileFacts("file-r91", "acme", "results", NOW - 91 * DAY),
             FileFacts("file-c8", "acme", "checkpoints", NOW - 8 * DAY),
             FileFacts("file-other", "beta", "datasets", NOW - 400 * DAY)]     # beta has no policy: forever
    got = {t.id: (t.reason, t.days) for t in plan(files, [], policies, set(), NOW, limit=100).tasks}
    assert got == {"file-d30": ("retention", 30), "file-r91": ("retention", 90), "file-c8": ("retention", 7)}


def test_ended_jobs_lose_checkpoints_and_logs_after_the_policy_and_only_once() -> None:
    policy = {"checkpoints": 7, "logs": 14}
    assert job_tasks(ended("j1", age=6 * DAY), policy, NOW) == []
    assert [t.what for t in job_tasks(ended("j1", age=8 * DAY), policy, NOW)] == ["checkpoints"]
    assert [t.what for t in job_tasks(ended("j1", age=15 * DAY), policy, NOW)] == ["checkpoints", "logs"]
    done = frozenset({"checkpoints_at", "logs_at"})
    assert job_tasks(ended("j1", age=15 * DAY, done=done), policy, NOW) == []
    # no policy: an ended job's state is kept forever
    assert job_tasks(ended("j1", age=999 * DAY), {}, NOW) == []


@pytest.mark.parametrize("status", ["queued", "running", "validating_files", "paused", "publishing", "cancelling"])
def test_the_state_of_a_job_that_has_not_ended_is_never_touched(status: str) -> None:
    job = JobFacts("j1", "acme", status, NOW - 999 * DAY)     # finished_at set by mistake: the status decides
    assert job_tasks(job, {"checkpoints": 1, "logs": 1}, NOW) == []


def test_a_succeeded_job_is_pruned_once_and_its_checkpoints_age_as_published_files() -> None:
    policy = {"checkpoints": 1, "logs": 1}
    tasks = job_tasks(ended("j1", status="succeeded", age=5 * DAY), policy, NOW)
    # its training state goes (pruned), its logs by the policy; its kept checkpoints are files of kind checkpoints
    assert [(t.what, t.reason) for t in tasks] == [("prune", "published"), ("logs", "retention")]
    fresh = ended("j1", status="succeeded", age=0 * DAY)
    assert job_tasks(fresh, {}, NOW) == [Task("prune", "acme", "j1", "published")]
    assert job_tasks(ended("j1", status="succeeded", done=frozenset({"pruned_at"})), {}, NOW) == []


def test_the_plan_is_bounded_and_puts_prunes_and_expired_files_first() -> None:
    files = [dataset(f"file-r{i}", age=40 * DAY) for i in range(5)] + \
            [dataset(f"file-x{i}", expires_in=-DAY) for i in range(5)]
    jobs = [ended(f"j{i}", status="succeeded") for i in range(3)]
    p = plan(files, jobs, {"acme": {"datasets": 30}}, set(), NOW, limit=6)
    assert [t.what for t in p.tasks] == ["prune"] * 3 + ["file"] * 3
    assert all(t.reason == "expired" for t in p.tasks[3:])


def test_file_kinds_follow_the_layout() -> None:
    art = "art-" + "0" * 24
    assert file_kind(None) == "datasets"
    assert file_kind(layout.result_path(art, "adapter.tar")) == "results"
    assert file_kind(layout.result_path(art, layout.checkpoint_result(5))) == "checkpoints"


def test_policy_parsing() -> None:
    assert parse_days("30", "datasets") == 30
    assert parse_days("0", "logs") is None and parse_days("off", "logs") is None
    for bad in ("-1", "1.5", "x", "99999999"):
        with pytest.raises(ServiceError, match="--logs"):
            parse_days(bad, "logs")
    assert policy_of({"datasets": 3, "logs": 0, "bogus": 4, "results": True, "checkpoints": "7"}) == {"datasets": 3}
    assert policy_of(None) == {}


def test_remove_reports_the_bytes_it_freed(tmp_path: Path) -> None:
    """Direct mode (storage owned by this process): the verb's figure is the removed regular files' bytes,
    a file linked twice counted once, a symlink's target never counted nor followed."""
    run_verb(tmp_path, "acme", None, "sweep", {"min_age_s": 0}, [])          # makes the tenant root
    root = layout.tenant_root(tmp_path, "acme")
    ckpt = root.joinpath(*layout.checkpoint(JOB, 3))
    ckpt.mkdir(parents=True)
    (ckpt / "adapter.safetensors").write_bytes(b"a" * 1000)
    (ckpt / "state.pt").write_bytes(b"s" * 234)
    os.link(ckpt / "state.pt", ckpt / "hardlink")
    outside = tmp_path / "outside"
    outside.write_bytes(b"o" * 5000)
    (ckpt / "link").symlink_to(outside)
    reply = run_verb(tmp_path, "acme", None, "remove", {"paths": [list(p) for p in layout.training_state(JOB)]}, [])
    assert reply.result == {"removed": 1, "freed_bytes": 1234}
    assert not ckpt.exists() and outside.read_bytes() == b"o" * 5000
    assert run_verb(tmp_path, "acme", None, "remove", {"paths": [list(layout.checkpoint(JOB, 3))]}, []).result == \
        {"removed": 0, "freed_bytes": 0}
