"""The retention sweeper's pass, off the reconcile cycle: ``services.retention.sweep_pass`` every
``sweep_interval_s`` in a daemon thread of its own, one pass at a time, while this gateway leads.

The loop only asks ``start`` after each cycle (a clock check, no I/O): the pass reads the database and
deletes through the storage broker in its own thread and transactions, bounded by ``sweep_max_items``
deletions and ``sweep_budget_s`` seconds, so however much has expired no cycle waits for it. Its
deletions are fenced by the leader's lease (a deposed leader deletes nothing more).
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy.engine import Engine

from gateway.config import Settings
from gateway.jobs.leader import Lease, LeaseLost
from gateway.services.retention import SweepReport, sweep_pass
from gateway.storage import Storage

log = logging.getLogger(__name__)


class RetentionSweeper:
    """Starts a pass when one is due (``start``); ``last`` is the newest pass's report, ``passes`` how many ran,
    ``deleted`` and ``freed_bytes`` the totals since start (for /metrics)."""

    def __init__(self, engine: Engine, settings: Settings, storage: Storage):
        self.engine, self.settings, self.storage = engine, settings, storage
        self.last: SweepReport | None = None
        self.passes = 0
        self.deleted: dict[str, int] = {}
        self.freed_bytes = 0
        self._next = 0.0                 # the first pass comes with the first cycle this gateway leads
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        """Whether a pass is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, fence: Lease | None) -> bool:
        """Start a pass in a thread when one is due (every ``sweep_interval_s``; 0: never) and none runs;
        whether one started. Returns at once."""
        interval = self.settings.sweep_interval_s
        if interval <= 0:
            return False
        with self._lock:
            now = time.monotonic()
            if self.running or now < self._next:
                return False
            self._next = now + interval
            self._thread = threading.Thread(target=self._pass, args=(fence,), name="retention-sweeper", daemon=True)
            self._thread.start()
            return True

    def _pass(self, fence: Lease | None) -> None:
        try:
            report = sweep_pass(self.engine, self.settings, storage=self.storage, fence=fence, lost=(LeaseLost,))
            for what, n in report.deleted.items():
                self.deleted[what] = self.deleted.get(what, 0) + n
            self.freed_bytes += report.freed_bytes
            self.last = report
        except Exception:
            log.exception("retention sweep failed; retried next interval")
        finally:
            self.passes += 1

    def join(self, timeout: float | None = None) -> None:
        """Wait for the pass in flight (if any) to end, at most ``timeout`` seconds."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
