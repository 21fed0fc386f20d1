"""Cleanup confirmation: a job that ended on nodes stays ``cleanup: pending`` until the epilog's
scrub report of every node it ran on says the node is clean (``confirmed``) or not (``failed``:
the node was drained for an administrator). Local mode has no nodes and no scrubber: ``off``.

The reconciler calls ``confirm_cleanups`` once per cycle; the reports are files the epilog writes
(``gateway.slurm.scrubreports``), so no Slurm command runs here.
"""

from __future__ import annotations

from sqlmodel import Session, select

from gateway.config import Settings
from gateway.models import FineTuningJob
from gateway.services.jobwrites import StaleJob, add_event, update_fields
from gateway.slurm.records import SlurmParseError, expand_nodelist
from gateway.slurm.scrubreports import ScrubReportError, read_report, report_path
from gateway.state import Cleanup


def confirm_cleanups(s: Session, settings: Settings) -> None:
    """Settle every job whose cleanup is pending, as its nodes' epilog reports (or local mode) say."""
    for job in list(s.exec(select(FineTuningJob).where(FineTuningJob.cleanup == Cleanup.PENDING))):
        if settings.local:       # no nodes, no scrubber: nothing will ever confirm a cleanup
            # said once at start (LOCAL MODE); per job it is a fact, not a warning (issue 35)
            _set_cleanup(s, job, Cleanup.OFF, "Local mode: the job ran on this machine, which no scrubber cleans",
                         "info")
        elif not (job.progress or {}).get("node") and job.started_at is None:
            # ended before any node was named (an older gateway set such rows pending): no epilog reports
            _set_cleanup(s, job, None, "No node cleanup: the job never ran on a node", "info")
        elif (ok := epilog_ok(settings, job)) is not None:
            if ok:
                _set_cleanup(s, job, Cleanup.CONFIRMED, "Node cleanup confirmed by the epilog", "info")
            else:
                _set_cleanup(s, job, Cleanup.FAILED,
                             "Node cleanup FAILED: the node was drained for an administrator", "warn")


def epilog_ok(settings: Settings, job: FineTuningJob) -> bool | None:
    """Whether the epilog's scrub reports for ``job`` say every node of it is clean: False when
    one is not (or its list cannot be read), None while a node's report is missing."""
    nodelist = (job.progress or {}).get("node")
    if not nodelist or job.slurm_job_id is None:
        return None
    try:
        nodes = expand_nodelist(str(nodelist))
    except SlurmParseError:
        return False
    verdicts: list[bool | None] = []
    for node in nodes:
        path = report_path(settings.scrub_report_dir, node, job.slurm_job_id, "epilog")
        if not path.exists():
            verdicts.append(None)
            continue
        try:
            verdicts.append(read_report(path).ok)
        except ScrubReportError:
            verdicts.append(False)
    if False in verdicts or not verdicts:
        return False
    return None if None in verdicts else True


def _set_cleanup(s: Session, job: FineTuningJob, cleanup: str | None, message: str, level: str) -> None:
    try:
        update_fields(s, job, cleanup=cleanup)
        add_event(s, job.id, message, level=level)
        s.commit()
    except StaleJob:
        s.rollback()
