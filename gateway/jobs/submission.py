"""Turning a recorded job into an sbatch submission as the tenant's unix user."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.models import FineTuningJob
from gateway.services import jobcreate
from gateway.slurm.admin import Admin
from gateway.slurm.local import QOS as LOCAL_QOS
from gateway.slurm.render import JobScript, warning_s
from gateway.slurm.scheduler import Scheduler
from gateway.storage import TenantRunner, layout, storage_for
from gateway.storage.layout import unix_user_for
from trainer.contract import jobdir
from trainer.contract.spec import JobSpec

Submit = jobcreate.Submit        # the seam services call; Submitter is its implementation

QOS_TIERS: tuple[tuple[str, int, int], ...] = (
    ("ft-small", 240, 1), ("ft-standard", 1440, 2), ("ft-large", 4320, 4))
"""The tiers ``finetune tenants add`` creates, smallest first: (name, MaxWall minutes,
MaxTRESPerUser GPUs), as ``slurm_templates/qos_policy.toml`` applies them."""


def pick_qos(allowed: tuple[str, ...], minutes: int, gpus: int = 1) -> str:
    """The smallest tier that fits the time and the GPUs; tiers the tenant lacks are skipped.

    Raises ServiceError (naming the limit) when no tier of the tenant allows ``gpus``. A tier of
    another name (a site's own) has limits we do not know: Slurm decides for it."""
    if not allowed:
        raise ServiceError("the tenant has no QOS tier: ask your administrator")
    known = {name: (wall, max_gpus) for name, wall, max_gpus in QOS_TIERS}
    fits_gpus = [t for t in allowed if t not in known or gpus <= known[t][1]]
    if not fits_gpus:
        most = max(allowed, key=lambda t: known[t][1])
        raise ServiceError(
            f"the job asks for {gpus} GPUs but your QOS tiers allow at most {known[most][1]} per user "
            f"({most}: MaxTRESPerUser=gres/gpu={known[most][1]}): ask for fewer, or ask your administrator "
            "for a larger tier", param="resources.gpus", code="gpu_limit")
    for tier, max_min, _ in QOS_TIERS:
        if tier in fits_gpus and minutes <= max_min:
            return tier
    return fits_gpus[0]


CANCEL_MARGIN_S = 3


def cancel_grace_s(settings: Settings) -> int:
    """How long a job's batch script lets the trainer stop after the gateway's cancel before it kills
    it itself: ``CANCEL_MARGIN_S`` under the gateway's ``cancel_deadline_s``, so the script, not the
    gateway's KILL to the batch step, ends a slow trainer, and Slurm records the job CANCELLED
    (a KILLed batch step is FAILED 0:9)."""
    return max(1, int(settings.cancel_deadline_s) - CANCEL_MARGIN_S)


def trainer_command(settings: Settings, spec_path: object) -> tuple[str, ...]:
    """What a job runs: the trainer on its spec, or, where the site simulates
    (``simulate_trainer_speedup``), ``trainer.simulate`` at that speed-up."""
    if settings.simulate_trainer_speedup:
        return (str(settings.runtime_python), "-m", "trainer.simulate", str(spec_path),
                "--speedup", f"{settings.simulate_trainer_speedup:g}")
    return (str(settings.runtime_python), "-m", "trainer", "run", str(spec_path))


class Submitter:
    """``submit(job, spec, tenant) -> (slurm job id, qos)``; raises SlurmError with Slurm's text."""

    def __init__(self, settings: Settings, client: Scheduler, qos_ttl_s: float = 60.0):
        self.settings, self.client, self.qos_ttl_s = settings, client, qos_ttl_s
        self._qos: dict[str, tuple[float, tuple[str, ...]]] = {}
        self._lock = threading.Lock()

    def allowed_qos(self, tenant: str) -> tuple[str, ...]:
        """The QOS tiers the tenant's account may use (cached ``qos_ttl_s``); local mode's one ``local``.
        Raises KeyError for a tenant without a Slurm account."""
        if self.settings.local:
            return (LOCAL_QOS,)
        with self._lock:
            hit = self._qos.get(tenant)
            if hit and time.monotonic() - hit[0] < self.qos_ttl_s:
                return hit[1]
        admin = Admin(self.client.runner, parent_account=self.settings.parent_account)
        allowed = admin.get_account(tenant).qos
        with self._lock:
            self._qos[tenant] = (time.monotonic(), allowed)
        return allowed

    def qos_for(self, tenant: str, minutes: int, gpus: int = 1) -> str:
        """The QOS tier a job of ``minutes`` on ``gpus`` GPUs would get (admission, the portal's
        estimate and submission use it); ServiceError naming the limit if no tier allows the GPUs."""
        return pick_qos(self.allowed_qos(tenant), minutes, gpus)

    def __call__(self, job: FineTuningJob, spec: JobSpec, tenant: str) -> tuple[int, str]:
        qos = self.qos_for(tenant, job.time_limit_min or 60, job.gpus)
        script = self._script(job, spec, tenant, qos)
        if self.settings.local:      # no tenant users: the local scheduler runs it as this user
            return self.client.submit(script), qos
        if self.settings.ssh_host:   # off-cluster: the login node's root account submits with --uid
            return self.client.submit(script, user=unix_user_for(tenant)), qos
        # sbatch runs as the tenant; the id it prints is checked against Slurm's own record of the job
        return self.client.submit(script, user=unix_user_for(tenant),
                                  runner=TenantRunner(storage_for(self.settings).tenant(tenant))), qos

    def _script(self, job: FineTuningJob, spec: JobSpec, tenant: str, qos: str,
                write: bool = True) -> JobScript:
        store = storage_for(self.settings).tenant(tenant)
        spec_path = store.write_spec(job.id, spec) if write \
            else store.absolute(layout.job_file(job.id, jobdir.SPEC))   # a dry run (estimate) writes nothing
        return JobScript(
            job_name=job.id, account=tenant, qos=qos, job_dir=spec.job_dir,
            command=trainer_command(self.settings, spec_path),
            gpus=job.gpus // job.nodes, nodes=job.nodes, cpus=self.settings.job_cpus,
            mem_mb=self.settings.job_mem_mb * (job.gpus // job.nodes),
            time_limit_min=job.time_limit_min or 60,
            grace_s=warning_s(self.settings.signal_grace_s, job.time_limit_min or 60),
            cancel_grace_s=cancel_grace_s(self.settings),
            partition=self.settings.slurm_partition,
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                 **self.settings.test_job_env})   # the test suite's SFT_TEST_* only (config)

    def array(self, jobs: list[FineTuningJob], specs: list[JobSpec], tenant: str,
              name: str) -> tuple[int, list[int], str]:
        """Submit ``jobs`` as the tasks of ONE job array named ``name`` under one QOS (the one the
        longest of them gets): held, each task named after its job (which gives it a job id of its
        own), then released. Returns (array id, each job's Slurm job id, qos). On any failure after
        sbatch the whole array is cancelled before the error is raised: no task runs unrecorded.
        A gateway that dies between sbatch and naming leaves a held array named ``name`` behind
        (nothing runs); the reconciler resubmits those jobs one by one."""
        if self.settings.local:       # refused before a script is written (LocalScheduler refuses too)
            raise ServiceError("job arrays need Slurm: submit the jobs one by one", code="no_backend")
        qos = self.qos_for(tenant, max(j.time_limit_min or 60 for j in jobs), max(j.gpus for j in jobs))
        scripts = [self._script(job, spec, tenant, qos) for job, spec in zip(jobs, specs, strict=True)]
        runner = None if self.settings.ssh_host else TenantRunner(storage_for(self.settings).tenant(tenant))
        array_id, ids = self.client.submit_named_array(scripts, name=name, task_names=[job.id for job in jobs],
                                                       user=unix_user_for(tenant), runner=runner)
        return array_id, ids, qos

    def expected_start(self, job: FineTuningJob, spec: JobSpec, tenant: str) -> StartEstimate:
        """When ``job`` (not submitted) would start, and why not now: the QOS tier's per-user GPU
        limit first (``sbatch --test-only`` ignores QOS limits), then Slurm's own plan
        (``--test-only``, as the tenant: resources and priority). Local mode: now."""
        qos = self.qos_for(tenant, job.time_limit_min or 60, job.gpus)
        client = self.client
        if self.settings.local:
            return StartEstimate(qos, datetime.now(UTC), None, None)      # local mode: no queue
        admin = Admin(client.runner, parent_account=self.settings.parent_account)
        cap = next((q.max_gpus_per_user for q in admin.show_qos() if q.name == qos), None)
        running = [r for r in client.running_gpus(tenant) if r[1] == qos]
        used = sum(r[2] for r in running)
        if cap is not None and used + job.gpus > cap:
            ends = sorted(r[3] for r in running if r[3] is not None)
            need = used + job.gpus - cap
            freed, when = 0, None
            for r in sorted(running, key=lambda r: r[3] or datetime.max.replace(tzinfo=UTC)):
                freed += r[2]
                if freed >= need:
                    when = r[3]
                    break
            return StartEstimate(qos, when or (ends[-1] if ends else None), "QOSMaxGRESPerUser",
                                 f"your tenant runs {used} of the {cap} GPUs QOS {qos} allows at once: "
                                 "it starts when enough of them finish (at the latest their time limits)")
        script = self._script(job, spec, tenant, qos, write=False)
        runner = None if self.settings.ssh_host else TenantRunner(storage_for(self.settings).tenant(tenant))
        start, nodes = client.test_only(script, runner=runner)
        now = datetime.now(UTC)
        if start is None or start <= now + timedelta(seconds=5):
            return StartEstimate(qos, now, None, None, nodes)
        return StartEstimate(qos, start, "Resources", "the cluster has no free GPUs for it until then "
                             "(Slurm's plan: running jobs' time limits and the jobs ahead of it)", nodes)


@dataclass(frozen=True)
class StartEstimate:
    """When a job would start: the QOS it gets, the expected start (None: unknown), Slurm's reason
    word and our words when it is not now, and the nodes Slurm would use."""

    qos: str
    start: datetime | None
    reason: str | None
    why: str | None
    nodes: str | None = None
