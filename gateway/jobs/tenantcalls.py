"""Per-tenant storage calls of a reconcile cycle, isolated from each other.

Each tenant's call (its events read, its temp sweep) runs on a daemon thread of its own (at most WORKERS at once),
side by side with the other tenants', and the cycle waits for all of them together for a
bounded time. A tenant that has not answered by then is left for a later cycle; while its
call still runs, or for a doubling pause after one failed or answered late, it is not called
again. So a tenant that stops its broker child (or whose storage hangs) costs the others at
most one bounded wait now and then, and never a pile of threads or broker children.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gateway.errors import ServiceError

log = logging.getLogger(__name__)
T = TypeVar("T")
WORKERS = 8
PAUSE_MIN_S = 1.0        # the pause after a tenant's first failed or late call; it doubles per repeat
PAUSE_MAX_S = 60.0


@dataclass
class Round(Generic[T]):
    """One round's outcome, by tenant: what answered in time, what failed (its exception),
    what was still running at the deadline (``late``) and what was not called (``skipped``:
    its previous call still runs, it is pausing after a failure, or the pool never reached it);
    ``repeated``: the failed or late ones that had failed before and not yet recovered (log those once)."""

    results: dict[str, T] = field(default_factory=dict)
    failed: dict[str, Exception] = field(default_factory=dict)
    late: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    repeated: set[str] = field(default_factory=set)


class TenantCalls:
    """Runs one call per tenant at a time, at most ``WORKERS`` at once, each on its own daemon thread;
    thread-safe."""

    def __init__(self, workers: int = WORKERS, clock: Callable[[], float] = time.monotonic):
        self.workers, self.clock = workers, clock
        self._lock = threading.Lock()
        self._running = 0
        self._busy: set[str] = set()
        self._pause: dict[str, tuple[float, float]] = {}   # tenant -> (not before, length of its pause)

    def run(self, calls: Mapping[str, Callable[[], T]], wait_s: float) -> Round[T]:
        """Start each tenant's call unless it is busy or pausing; wait at most ``wait_s`` for all
        of them together. A late call keeps running (its result is dropped) and keeps its tenant busy."""
        out: Round[T] = Round()
        started: dict[str, Future[T]] = {}
        troubled: set[str] = set()
        now = self.clock()
        for tenant, fn in calls.items():
            with self._lock:
                if tenant in self._busy or self._pause.get(tenant, (0.0, 0.0))[0] > now:
                    out.skipped.append(tenant)
                    continue
                self._busy.add(tenant)
                if tenant in self._pause:
                    troubled.add(tenant)
            started[tenant] = self._submit(tenant, fn)
        if started:
            wait([f for f in started.values() if not f.cancelled()], timeout=wait_s)
        for tenant, fut in started.items():
            if fut.cancelled():                       # too many calls still running: no fault of its own
                self._finish(tenant, ok=None)
                out.skipped.append(tenant)
            elif not fut.done():
                out.late.append(tenant)
                self._penalise(tenant)                # still busy until its call returns
            elif (exc := fut.exception()) is not None:
                out.failed[tenant] = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
            else:
                out.results[tenant] = fut.result()
        out.repeated = troubled - set(out.results)
        return out

    def busy(self, tenant: str) -> bool:
        """Whether ``tenant`` has a call still running."""
        with self._lock:
            return tenant in self._busy

    # ----------------------------------------------------------------- internals
    def _submit(self, tenant: str, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on a thread of its own, or, with ``workers`` calls already running (stalled
        tenants), not at all: a cancelled future (skipped, no fault of the tenant's). A thread per
        call, never a queue behind a stalled one: one tenant in flight at a time bounds them."""
        fut: Future[T] = Future()
        with self._lock:
            if self._running >= self.workers:
                fut.cancel()
                return fut
            self._running += 1
        threading.Thread(target=self._work, args=(tenant, fn, fut), name=f"tenant-call-{tenant}",
                         daemon=True).start()
        return fut

    def _work(self, tenant: str, fn: Callable[[], Any], fut: Future[Any]) -> None:
        fut.set_running_or_notify_cancel()
        try:
            result, error = fn(), None
        except BaseException as e:   # noqa: BLE001 - handed to the round that waits for it
            result, error = None, e
        with self._lock:
            self._running -= 1
        self._finish(tenant, ok=error is None)     # before the waiter wakes: its next round may call again
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)

    def _finish(self, tenant: str, ok: bool | None) -> None:
        """The tenant's call ended: succeeded (its pause halves), failed (it doubles) or never ran."""
        with self._lock:
            self._busy.discard(tenant)
        if ok is False:
            self._penalise(tenant)
        elif ok:
            with self._lock:
                until, length = self._pause.pop(tenant, (0.0, 0.0))
                if length / 2 >= PAUSE_MIN_S:
                    self._pause[tenant] = (until, length / 2)   # one success does not forgive a habit

    def _penalise(self, tenant: str) -> None:
        with self._lock:
            length = min(PAUSE_MAX_S, max(PAUSE_MIN_S, 2 * self._pause.get(tenant, (0.0, 0.0))[1]))
            self._pause[tenant] = (self.clock() + length, length)


def report(rnd: Round[T], verb: str, wait_s: float, missed: dict[tuple[str, str], int]) -> dict[str, T]:
    """Log a round of ``verb`` calls (once per run of failures: repeats while pausing at debug level),
    count in ``missed`` (by verb and outcome: ``LoopStats.storage_missed``) the tenants that failed,
    were late or were skipped; the answers by tenant."""
    for name, e in rnd.failed.items():
        level = logging.DEBUG if name in rnd.repeated else logging.WARNING
        if isinstance(e, ServiceError):
            log.log(level, "tenant %s: %s failed: %s (it pauses; the others go on)", name, verb, e.message)
        else:      # a bug in one tenant's call must not fail every tenant's cycle
            log.error("tenant %s: %s failed", name, verb, exc_info=e)
    for name in rnd.late:
        log.log(logging.DEBUG if name in rnd.repeated else logging.WARNING, "tenant %s: storage %s did not "
                "answer within %.1fs: left for a later cycle (the others go on)", name, verb, wait_s)
    for outcome, n in (("error", len(rnd.failed)), ("late", len(rnd.late)), ("skipped", len(rnd.skipped))):
        if n:
            missed[verb, outcome] = missed.get((verb, outcome), 0) + n
    return rnd.results
