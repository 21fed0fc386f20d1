"""What the reconciler loop counts: one cycle's figures (``CycleStats``, returned by ``cycle``), and
the loop's since start (``LoopStats``), which /metrics reports (``gateway.api.metrics``)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

RECENT_CYCLES = 4096
"""How many of the latest cycles' seconds the loop keeps for its quantiles (at the default 2 s
interval, over two hours)."""


@dataclass
class CycleStats:
    jobs: int = 0
    slurm_calls: int = 0
    changed: int = 0
    published: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class LoopStats:
    """What the loop did since start, for /metrics: cycles, their seconds, the failed ones by cause, and
    the tenants' storage calls that gave a cycle no answer, by (verb, outcome): ``error``, ``late`` (the
    cycle stopped waiting) or ``skipped`` (not made: the tenant's previous call still ran, or it pauses
    after a failure)."""

    cycles: int = 0
    seconds: float = 0.0
    last_seconds: float = 0.0
    failed: dict[str, int] = field(default_factory=dict)
    storage_missed: dict[tuple[str, str], int] = field(default_factory=dict)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_CYCLES))

    def observe(self, seconds: float, failed: str | None = None) -> None:
        """Count one cycle of ``seconds`` (``failed``: why it failed, "slurm", "lease" or "internal")."""
        self.cycles += 1
        self.seconds += seconds
        self.last_seconds = seconds
        self.recent.append(seconds)
        if failed:
            self.failed[failed] = self.failed.get(failed, 0) + 1

    def quantiles(self, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[float, float]:
        """Each q-quantile (nearest rank) of the latest cycles' seconds; {} before the first cycle."""
        values = sorted(self.recent)
        if not values:
            return {}
        n = len(values)
        return {q: values[min(n - 1, max(0, math.ceil(round(q * n, 6)) - 1))] for q in qs}
