"""The composition root: what a gateway process runs on, built from its settings in one place.

``build_backend(settings)`` opens the database (migrated, audit chain anchored), picks the
scheduler (Slurm when it answers, the local one in local mode, else none: files work, jobs
cannot be submitted), and wires the Submitter and the Reconciler to them. ``finetune serve``
(through ``gateway.app.create_app``), ``finetune reconcile``, the demo and the tests all
start here. It may import everything below it; nothing imports it but the entry points.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.engine import Engine

from gateway.access.audit import open_database
from gateway.config import Settings
from gateway.jobs.reconciler import Reconciler
from gateway.jobs.submission import Submitter
from gateway.slurm import SlurmClient, make_runner
from gateway.slurm.local import LocalScheduler
from gateway.slurm.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class Backend:
    settings: Settings
    engine: Engine
    scheduler: Scheduler | None  # SlurmClient, gateway.slurm.local.LocalScheduler, or None
    submitter: Submitter | None
    reconciler: Reconciler | None


def scheduler_for(settings: Settings) -> Scheduler | None:
    """The scheduler jobs go to: the local one (local mode), the Slurm client when Slurm
    answers, else None."""
    if settings.local:
        return LocalScheduler(settings)
    client = SlurmClient(make_runner(settings), timeout=settings.slurm_timeout_s)
    return client if client.ping() else None


def build_backend(settings: Settings, *, scheduler: Scheduler | None = None,
                  run_migrations: bool = True) -> Backend:
    """Database, scheduler (``scheduler`` given, else ``scheduler_for``), Submitter, Reconciler."""
    engine = open_database(settings, run_migrations=run_migrations)
    if scheduler is None:
        scheduler = scheduler_for(settings)
    if scheduler is None:
        log.warning("Slurm does not answer: files work, fine-tuning jobs cannot be submitted")
        return Backend(settings, engine, None, None, None)
    submitter = Submitter(settings, scheduler)
    return Backend(settings, engine, scheduler, submitter, Reconciler(engine, settings, scheduler, submitter))
