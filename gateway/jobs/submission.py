"""Turning a recorded job into an sbatch submission as the tenant's unix user."""

from __future__ import annotations

import threading
import time
from typing import Any

from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.jobs.scheduler import Scheduler
from gateway.models import FineTuningJob
from gateway.services import jobs as job_service
from gateway.slurm.admin import Admin, unix_user_for
from gateway.slurm.render import JobScript
from gateway.storage import TenantRunner, storage_for

Submit = job_service.Submit        # the seam services call; Submitter is its implementation

QOS_TIERS: tuple[tuple[str, int], ...] = (("ft-small", 240), ("ft-standard", 1440), ("ft-large", 4320))
"""The tiers ``finetune tenants add`` creates, smallest first, with their MaxWall in minutes."""


def pick_qos(allowed: tuple[str, ...], minutes: int) -> str:
    """The smallest tier that fits the time; tiers the tenant lacks are skipped."""
    for tier, max_min in QOS_TIERS:
        if minutes <= max_min and tier in allowed:
            return tier
    if not allowed:
        raise ServiceError("the tenant has no QOS tier: ask your administrator")
    return allowed[0]


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
            from gateway.local import QOS

            return (QOS,)
        with self._lock:
            hit = self._qos.get(tenant)
            if hit and time.monotonic() - hit[0] < self.qos_ttl_s:
                return hit[1]
        admin = Admin(self.client.runner, storage_root=self.settings.storage_root,
                      parent_account=self.settings.parent_account)
        allowed = admin.get_tenant(tenant).qos
        with self._lock:
            self._qos[tenant] = (time.monotonic(), allowed)
        return allowed

    def qos_for(self, tenant: str, minutes: int) -> str:
        """The QOS tier a job of ``minutes`` would get (used by admission and the portal's estimate)."""
        return pick_qos(self.allowed_qos(tenant), minutes)

    def __call__(self, job: FineTuningJob, spec: dict[str, Any], tenant: str) -> tuple[int, str]:
        user = unix_user_for(tenant)
        qos = self.qos_for(tenant, job.time_limit_min or 60)
        store = storage_for(self.settings).tenant(tenant)
        spec_path = store.write_spec(job.id, spec)       # as the tenant, through the broker
        script = JobScript(
            job_name=job.id, account=tenant, qos=qos, job_dir=spec["job_dir"],
            command=(str(self.settings.runtime_python), "-m", "trainer", "run", str(spec_path)),
            gpus=1, cpus=self.settings.job_cpus, mem_mb=self.settings.job_mem_mb,
            time_limit_min=job.time_limit_min or 60, grace_s=self.settings.signal_grace_s,
            partition=self.settings.slurm_partition,
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        if self.settings.local:      # no tenant users: the local scheduler runs it as this user
            return self.client.submit(script), qos
        if self.settings.ssh_host:   # off-cluster: the login node's root account submits with --uid
            return self.client.submit(script, user=user), qos
        return self.client.submit(script, runner=TenantRunner(store)), qos
