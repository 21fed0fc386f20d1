"""The reconciler's slow calls, off its loop: Slurm's cancel, pause and release of a job, the
webhook deliveries, the MLflow logging and the checkpoints of a job that ended unpublished, each in
a daemon thread of its own.

A cancel waits for Slurm to confirm no process is left (up to ``cancel_deadline_s`` and the kill
wait); a webhook receiver or a tracking server may take its time: none may delay a cycle or an
API request. At most one cancel and one pause per Slurm job, one delivery run and one MLflow pass
are in flight at a time; the reconciler repeats a cancel or pause each cycle while Slurm still
runs the job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy.engine import Engine
from sqlmodel import Session

from gateway.config import Settings
from gateway.errors import SlurmError
from gateway.jobs.leader import Lease
from gateway.models import FineTuningJob
from gateway.services import checkpointpub, mlflowlog, webhooks
from gateway.slurm.records import Owner
from gateway.slurm.scheduler import Scheduler
from gateway.storage import Storage

log = logging.getLogger(__name__)


class Workers:
    """Threads for ``start_cancel``, ``start_pause``, ``start_deliveries`` and ``start_tracking``; ``owner`` names whose
    Slurm jobs a tenant's are (``Reconciler.owner``)."""

    def __init__(self, engine: Engine, settings: Settings, client: Scheduler, owner: Callable[[str], Owner]):
        self.engine, self.settings, self.client, self.owner = engine, settings, client, owner
        self._lock = threading.Lock()
        self._running: set[str] = set()      # the thread names in flight: one of each at a time

    def _once(self, name: str, work: Callable[[], None]) -> None:
        """Run ``work`` in a daemon thread called ``name`` unless one of that name is still running;
        the name is free again when ``work`` ends, however it ends."""
        with self._lock:
            if name in self._running:
                return
            self._running.add(name)

        def run() -> None:
            try:
                work()
            finally:
                with self._lock:
                    self._running.discard(name)

        threading.Thread(target=run, name=name, daemon=True).start()

    def start_deliveries(self) -> None:
        """POST the due webhook deliveries (``services.webhooks.deliver_due``) in a thread, one at a time:
        a slow receiver never delays a cycle."""
        def work() -> None:
            try:
                webhooks.deliver_due(self.engine, self.settings)
            except Exception:
                log.exception("webhook deliveries failed")

        self._once("webhooks", work)

    def start_tracking(self) -> None:
        """Log the due MLflow runs (``services.mlflowlog.log_due``) in a thread, one pass at a time: a slow or
        absent tracking server never delays a cycle."""
        def work() -> None:
            try:
                mlflowlog.log_due(self.engine, self.settings)
            except Exception:
                log.exception("mlflow logging failed")

        self._once("mlflow", work)

    def start_checkpoints(self, job_id: str, tenant: str, storage: Storage, fence: Lease | None) -> None:
        """Make the complete checkpoints of ``job_id``, which ended unpublished, adapters
        (``services.checkpointpub.publish_checkpoints``) in a thread, once per job at a time: a tenant's
        large (or planted) checkpoint files are copied and hashed without delaying a cycle. Only the
        leader publishes (``fence``); an error is logged, and a continuation that asks publishes them."""
        def work() -> None:
            try:
                with Session(self.engine, expire_on_commit=False) as s:
                    job = s.get(FineTuningJob, job_id)
                    if job is None:
                        return
                    if fence is not None:
                        fence.check(s)
                    checkpointpub.publish_checkpoints(session=s, storage=storage, job=job, tenant_name=tenant)
            except Exception:
                log.exception("job %s: its checkpoints were not published", job_id)

        self._once(f"checkpoints-{job_id}", work)

    def start_cancel(self, slurm_id: int | None, tenant: str) -> None:
        """Run ``Scheduler.cancel`` in a thread, once per Slurm job at a time, for ``tenant``'s job only."""
        if slurm_id is None:
            return

        def work() -> None:
            try:
                res = self.client.cancel(slurm_id, owner=self.owner(tenant), deadline_s=self.settings.cancel_deadline_s)
                log.info("Slurm job %s stopped %.2fs after cancel (escalated=%s)", slurm_id, res.seconds,
                         res.escalated)
            except SlurmError as e:
                log.warning("cancel of Slurm job %s: %s", slurm_id, e)

        self._once(f"cancel-{slurm_id}", work)

    def start_pause(self, slurm_id: int | None, tenant: str) -> None:
        """Hold the Slurm job and send it the checkpoint signal (``Scheduler.pause``), once per
        job at a time, in a thread; the reconciler repeats it while Slurm still runs the job."""
        if slurm_id is None:
            return

        def work() -> None:
            try:
                was = self.client.pause(slurm_id, owner=self.owner(tenant))
                log.info("Slurm job %s: pause (was %s)", slurm_id, was)
            except SlurmError as e:
                log.warning("pause of Slurm job %s: %s", slurm_id, e)

        self._once(f"pause-{slurm_id}", work)

    def release(self, slurm_id: int | None, tenant: str) -> None:
        """Release ``tenant``'s Slurm job's hold now (the resume); SlurmError when Slurm refuses or the
        job is not the tenant's."""
        if slurm_id is not None:
            self.client.release(slurm_id, owner=self.owner(tenant))
