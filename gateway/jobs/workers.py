"""The reconciler's slow calls, off its loop: Slurm's cancel, pause and release of a job, and the
webhook deliveries, each in a daemon thread of its own.

A cancel waits for Slurm to confirm no process is left (up to ``cancel_deadline_s`` and the kill
wait); a webhook receiver may take its time: neither may delay a cycle or an API request. At most
one cancel and one pause per Slurm job, and one delivery run, are in flight at a time; the
reconciler repeats a cancel or pause each cycle while Slurm still runs the job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy.engine import Engine

from gateway.config import Settings
from gateway.errors import SlurmError
from gateway.services import webhooks
from gateway.slurm.records import Owner
from gateway.slurm.scheduler import Scheduler

log = logging.getLogger(__name__)


class Workers:
    """Threads for ``start_cancel``, ``start_pause`` and ``start_deliveries``; ``owner`` names whose
    Slurm jobs a tenant's are (``Reconciler.owner``)."""

    def __init__(self, engine: Engine, settings: Settings, client: Scheduler, owner: Callable[[str], Owner]):
        self.engine, self.settings, self.client, self.owner = engine, settings, client, owner
        self._lock = threading.Lock()
        self._cancelling: set[int] = set()
        self._pausing: set[int] = set()
        self._delivering = False

    def start_deliveries(self) -> None:
        """POST the due webhook deliveries (``services.webhooks.deliver_due``) in a thread, one at a time:
        a slow receiver never delays a cycle."""
        with self._lock:
            if self._delivering:
                return
            self._delivering = True

        def work() -> None:
            try:
                webhooks.deliver_due(self.engine, self.settings)
            except Exception:
                log.exception("webhook deliveries failed")
            finally:
                with self._lock:
                    self._delivering = False

        threading.Thread(target=work, name="webhooks", daemon=True).start()

    def start_cancel(self, slurm_id: int | None, tenant: str) -> None:
        """Run ``Scheduler.cancel`` in a thread, once per Slurm job at a time, for ``tenant``'s job only."""
        if slurm_id is None:
            return
        with self._lock:
            if slurm_id in self._cancelling:
                return
            self._cancelling.add(slurm_id)

        def work() -> None:
            try:
                res = self.client.cancel(slurm_id, owner=self.owner(tenant), deadline_s=self.settings.cancel_deadline_s)
                log.info("Slurm job %s stopped %.2fs after cancel (escalated=%s)", slurm_id, res.seconds,
                         res.escalated)
            except SlurmError as e:
                log.warning("cancel of Slurm job %s: %s", slurm_id, e)
            finally:
                with self._lock:
                    self._cancelling.discard(slurm_id)

        threading.Thread(target=work, name=f"cancel-{slurm_id}", daemon=True).start()

    def start_pause(self, slurm_id: int | None, tenant: str) -> None:
        """Hold the Slurm job and send it the checkpoint signal (``Scheduler.pause``), once per
        job at a time, in a thread; the reconciler repeats it while Slurm still runs the job."""
        if slurm_id is None:
            return
        with self._lock:
            if slurm_id in self._pausing:
                return
            self._pausing.add(slurm_id)

        def work() -> None:
            try:
                was = self.client.pause(slurm_id, owner=self.owner(tenant))
                log.info("Slurm job %s: pause (was %s)", slurm_id, was)
            except SlurmError as e:
                log.warning("pause of Slurm job %s: %s", slurm_id, e)
            finally:
                with self._lock:
                    self._pausing.discard(slurm_id)

        threading.Thread(target=work, name=f"pause-{slurm_id}", daemon=True).start()

    def release(self, slurm_id: int | None, tenant: str) -> None:
        """Release ``tenant``'s Slurm job's hold now (the resume); SlurmError when Slurm refuses or the
        job is not the tenant's."""
        if slurm_id is not None:
            self.client.release(slurm_id, owner=self.owner(tenant))
