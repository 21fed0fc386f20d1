"""Facts only the gateway knows: cancellations (with their stop latency) and scrub failures.

This is a SEAM. The gateway DB that will record them (a cancel request time
per job, the time Slurm confirmed the stop, and the epilog's scrub reports)
does not exist yet, so ``load_gateway_facts`` returns None and reports say
"not available" instead of a misleading zero. When the DB lands, implement
``load_gateway_facts`` with one query per table over the window; the report
code (``accounting.usage``) already consumes these typed rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from accounting.window import Window

NOT_AVAILABLE = "gateway DB not available yet: cancellations and scrub failures are not reported"


@dataclass(frozen=True)
class Cancellation:
    job_id: int                 # Slurm job id (JobIDRaw)
    tenant: str
    requested_at: datetime      # the tenant's cancel request reached the gateway
    stopped_at: datetime | None  # Slurm confirmed no process left; None while still stopping

    @property
    def stop_latency_s(self) -> float | None:
        if self.stopped_at is None:
            return None
        return (self.stopped_at - self.requested_at).total_seconds()


@dataclass(frozen=True)
class ScrubFailure:
    job_id: int | None
    tenant: str | None
    node: str
    at: datetime
    reason: str


@dataclass(frozen=True)
class GatewayFacts:
    cancellations: tuple[Cancellation, ...] = ()
    scrub_failures: tuple[ScrubFailure, ...] = ()


def load_gateway_facts(database_url: str, window: Window) -> GatewayFacts | None:
    """Cancellations and scrub failures in ``window`` from the gateway DB.

    Returns None: the gateway DB has no such tables yet (see the module doc).
    """
    del database_url, window
    return None
