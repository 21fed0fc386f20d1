"""Shared checks for fault tests: after a fault every job reaches a correct final state,
none is lost or duplicated (DB rows vs Slurm jobs by name), no partial file is visible and
no cancelled or failed job has an artifact."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from sqlmodel import Session, select

from gateway.models import DataFile, FineTuningJob, JobEvent
from tests.slurm.livegateway import STORAGE, LiveGateway


def slurm_jobs_by_name(user: str, since: str) -> dict[str, set[int]]:
    """Slurm job ids per job name for ``user`` since ``since`` (sacct, allocations only;
    a requeued job keeps its id, so two ids for one name is a duplicate submission)."""
    res = subprocess.run(["sacct", "-n", "-X", "-P", "-D", "-u", user, "-S", since, "-o", "JobName,JobIDRaw"],
                         capture_output=True, text=True, timeout=60, check=True)
    out: dict[str, set[int]] = {}
    for line in res.stdout.splitlines():
        name, _, jid = line.partition("|")
        if name.startswith("ftjob-") and jid.isdigit():
            out.setdefault(name, set()).add(int(jid))
    # squeue --states=all also lists jobs that ended recently (accounting may still be catching up)
    q = subprocess.run(["squeue", "-h", "-t", "all", "-u", user, "-o", "%j|%i|%V"], capture_output=True, text=True,
                       timeout=60)
    for line in q.stdout.splitlines():
        name, jid, submitted = (line.split("|") + ["", ""])[:3]
        if name.startswith("ftjob-") and jid.isdigit() and submitted >= since:   # ISO times compare as text
            out.setdefault(name, set()).add(int(jid))
    return out


def assert_consistent(gw: LiveGateway, tenant: str, since: str, expect: dict[str, str],
                      sweep_wait_s: float = 0) -> dict[str, Any]:
    """Every job of ``tenant`` is terminal with the expected status (job id -> status), has
    exactly one Slurm job (by name), and storage holds only complete, owned artifacts."""
    with Session(gw.engine) as s:
        rows = {j.id: j for j in s.exec(select(FineTuningJob))}
        results = list(s.exec(select(DataFile).where(DataFile.purpose == "fine-tune-results")))
        published = {j: [e for e in s.exec(select(JobEvent).where(JobEvent.job_id == j))
                         if e.message == "The job has successfully completed"] for j in rows}
    mine = {k: v for k, v in rows.items() if k in expect}
    assert set(mine) == set(expect), f"lost or unexpected jobs: DB {sorted(rows)} vs expected {sorted(expect)}"
    by_name = slurm_jobs_by_name(f"sft-{tenant}", since)
    statuses = {k: v.status for k, v in mine.items()}
    assert statuses == expect, statuses
    for jid, job in mine.items():
        ids = by_name.get(jid, set())
        assert len(ids) <= 1, f"job {jid} was submitted {len(ids)} times: Slurm ids {sorted(ids)}"
        if job.slurm_job_id is not None:
            assert ids == {job.slurm_job_id}, (jid, ids, job.slurm_job_id)
        assert len(published[jid]) == (1 if job.status == "succeeded" else 0), (jid, len(published[jid]))
    strays = set(by_name) - set(rows)
    assert not strays, f"Slurm jobs with no DB row: {strays}"
    tdir = STORAGE / "tenants" / tenant
    arts = tdir / "artifacts"
    owners = {str(r.path).split("/")[1] for r in results if r.path and r.job_id in mine}
    deadline = time.monotonic() + sweep_wait_s
    while True:      # leftovers of a publication cut short are swept by the reconciler after a minute
        visible = {p.name for p in arts.iterdir()} if arts.exists() else set()
        leftovers = {n for n in visible if n.startswith(".")}
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not leftovers, f"partial publication left: {leftovers}"
    assert owners <= visible, f"published artifacts missing: {owners - visible}"
    for jid, job in mine.items():
        every = [r for r in results if r.job_id == jid]
        files = [r for r in every if "-checkpoint-step-" not in r.filename]     # its results; the rest: checkpoints
        if job.status == "succeeded":
            assert len(files) == 3 and sorted(job.result_files or []) == sorted(r.id for r in files), jid
            for r in every:
                assert (tdir / str(r.path)).is_file(), r.path
        else:
            assert files == [] and not job.result_files and job.fine_tuned_model is None, jid
    return {"slurm": by_name, "statuses": statuses}


def checkpoints_complete(job_dir: Path) -> list[str]:
    """Names in checkpoints/ that are not complete step dirs (should be empty after a job)."""
    d = job_dir / "checkpoints"
    if not d.exists():
        return []
    return [p.name for p in d.iterdir() if not (p.name.startswith("step-") and (p / "COMPLETE").is_file())]


def trainer_events(job_dir: Path) -> list[dict[str, Any]]:
    path = job_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
