"""A gateway that dies in the middle of a sweep's submission, on the real cluster: after sbatch (the
array is held) and after naming task 0, before naming the others or releasing any. The restarted
reconciler adopts and releases the named task, cancels the never-named ones (they never ran) and
submits their jobs again one by one: every run succeeds exactly once, none is lost."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, select

from tests.slurm.livegateway import FAST_HP, MODEL, LiveGateway, chat_file, terminal
from trainer.contract.spec import JobSpec

pytestmark = pytest.mark.slurm
T = "t-sweep-crash"
SHARED = {k: v for k, v in FAST_HP.items() if k != "learning_rate_multiplier"}


class Died(BaseException):
    """The gateway process ended here (nothing after this point of the submission ran)."""


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("sweep-crash"), (T,), SFT_SUBMISSION_GRACE_S="1",
                    SFT_SLURM_TIMEOUT_S="2", SFT_MAX_SWEEP_RUNS="3")
    yield g
    g.stop()


def _interrupted_sweep(gw: LiveGateway, train: str, val: str) -> tuple[list[str], int]:
    """Create a 3-run sweep in the gateway's database and run its submission up to the crash point,
    with the gateway's own parts (prepare_job, Submitter's scripts, SlurmClient) against real Slurm."""
    from gateway.access.tokens import Principal, Role
    from gateway.api.openai import to_ours
    from gateway.config import Settings
    from gateway.jobs.submission import Submitter
    from gateway.models import Sweep, Tenant
    from gateway.services import sweeps
    from gateway.slurm.client import SlurmClient
    from gateway.slurm.runner import LocalRunner
    from gateway.storage import TenantRunner, storage_for

    settings = Settings(database_url=gw.db_url, max_sweep_runs=3)
    real = Submitter(settings, SlurmClient(LocalRunner()))
    seen: dict[str, Any] = {}

    class DiesAfterNamingTask0:
        def __call__(self, job: Any, spec: JobSpec, tenant: str) -> tuple[int, str]:
            return real(job, spec, tenant)

        def qos_for(self, tenant: str, minutes: int, gpus: int = 1) -> str:
            return real.qos_for(tenant, minutes, gpus)

        def array(self, jobs: list[Any], specs: list[JobSpec], tenant: str,
                  name: str) -> tuple[int, list[int], str]:
            qos = real.qos_for(tenant, 60)
            scripts = [real._script(j, s, tenant, qos) for j, s in zip(jobs, specs, strict=True)]
            client = real.client
            assert isinstance(client, SlurmClient)
            seen["array"] = client.submit_array(scripts, name=name,
                                                runner=TenantRunner(storage_for(settings).tenant(tenant)))
            client.name_task(seen["array"], 0, jobs[0].id)
            raise Died

    with Session(gw.engine) as s:
        tenant = s.exec(select(Tenant).where(Tenant.name == T)).one()
        assert tenant.id is not None
        me = Principal(token_id=0, role=Role.MEMBER, tenant_id=tenant.id, tenant_name=T, unix_user=f"sft-{T}")
        req = sweeps.SweepRequest(training_file=train, validation_file=val, model=MODEL,
                                  grid={"lora_r": [4, 8, 16]}, hyperparameters=to_ours(SHARED))
        with pytest.raises(Died):
            sweeps.create_sweep(session=s, settings=settings, principal=me, req=req, submit=DiesAfterNamingTask0())
        sweep = s.exec(select(Sweep).where(Sweep.tenant_id == tenant.id)).one()
        return list(sweep.job_ids), int(seen["array"])


def test_an_interrupted_sweep_submission_loses_no_run_and_runs_none_twice(gw: LiveGateway, tmp_path: Path) -> None:
    train = gw.upload(T, chat_file(tmp_path / "t.jsonl", 40, seed=61))
    val = gw.upload(T, chat_file(tmp_path / "v.jsonl", 12, seed=62))
    job_ids, array = _interrupted_sweep(gw, train, val)
    done = {j: gw.wait(T, j, terminal, 300) for j in job_ids}
    assert {j: d["status"] for j, d in done.items()} == dict.fromkeys(job_ids, "succeeded"), \
        {j: d["error"] for j, d in done.items()}
    res = subprocess.run(["sacct", "-X", "-n", "-P", f"--jobs={array}", "--format=JobID,JobIDRaw,JobName,State"],
                         capture_output=True, text=True, timeout=30, check=True)
    print(f"\nsacct -j {array}:\n{res.stdout}")
    tasks = {row.split("|")[0]: row.split("|")[1:] for row in res.stdout.splitlines() if row.strip()}
    raw0, name0, state0 = tasks[f"{array}_0"]
    assert (name0, state0) == (job_ids[0], "COMPLETED") and done[job_ids[0]]["slurm_job_id"] == int(raw0)
    # tasks 1 and 2, never named, never ran: cancelled while held (one record while pending together)
    sweep_id = sweeps_name(gw, job_ids[0])
    unnamed = {jid: row for jid, row in tasks.items() if jid != f"{array}_0"}
    assert unnamed and all(name == sweep_id and state.startswith("CANCELLED") for _, name, state in unnamed.values())
    assert set(unnamed) <= {f"{array}_1", f"{array}_2", f"{array}_[1-2]"}, tasks
    events = {j: [e["message"] for e in gw.api("GET", f"/v1/fine_tuning/jobs/{j}/events?limit=100", T).json()["data"]]
              for j in job_ids}
    assert any(m.startswith("Recovered: Slurm job") for m in events[job_ids[0]])
    for j in job_ids[1:]:
        assert any(m.startswith("Submitting again") for m in events[j]), events[j]
        assert done[j]["slurm_job_id"] not in (int(r[0]) for r in tasks.values())   # a job of its own


def sweeps_name(gw: LiveGateway, job_id: str) -> str:
    """The sweep id a run belongs to (the name its array was submitted under)."""
    from gateway.models import FineTuningJob

    with Session(gw.engine) as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None and job.sweep_id
        return job.sweep_id
