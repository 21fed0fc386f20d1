"""Append-only progress events (``<job_dir>/events.jsonl``).

Each event is one JSON line written with a single ``os.write`` on an
``O_APPEND`` descriptor, then fsynced, so a reader never sees half a line
from a crash and concurrent appenders never interleave. Events carry counts
and metrics only, never dataset text.
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

EVENT_TYPES = frozenset(
    {"start", "phase", "metrics", "eval", "checkpoint", "early_stop", "done", "stopped", "failed", "heartbeat"}
)
PHASES = frozenset({"tokenizing", "reference", "training", "evaluating", "saving"})
HEARTBEAT_S = 30.0        # at most one heartbeat this often


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class EventLog:
    """Writer of ``events.jsonl`` for one attempt of one job.

    ``write=False`` (data-parallel ranks other than 0): events are built and
    returned but the file is neither created nor written.
    """

    def __init__(self, path: str | Path, attempt: int, job_id: str | None = None, write: bool = True) -> None:
        self.path = Path(path)
        self.attempt = attempt
        self.job_id = job_id
        self.write = write
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if write else -1
        self._beat = time.monotonic()
        self._phase: str | None = None     # the last phase recorded

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        """Append one event and fsync it; return the event written.

        Raises:
            ValueError: unknown event type.
        """
        if type_ not in EVENT_TYPES:
            raise ValueError(f"unknown event type {type_!r}")
        event: dict[str, Any] = {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "unix": round(time.time(), 3),
            "type": type_,
            "attempt": self.attempt,
        }
        if self.job_id is not None:
            event["job_id"] = self.job_id
        event.update({k: _clean(v) for k, v in fields.items()})
        line = (json.dumps(event, separators=(",", ":"), allow_nan=False) + "\n").encode()
        if self.write:
            os.write(self._fd, line)
            os.fsync(self._fd)
        return event

    def heartbeat(self) -> None:
        """Say the trainer is alive, at most every HEARTBEAT_S seconds (it is called far more often)."""
        now = time.monotonic()
        if now - self._beat >= HEARTBEAT_S:
            self._beat = now
            self.emit("heartbeat")

    def phase(self, name: str) -> None:
        """Record a phase change (tokenizing, reference (DPO: scoring the pairs once), training, evaluating,
        saving); the phase it is already in is not recorded again (the tenant's events once said
        "Phase: training" twice: after the first eval, then at the first step)."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}")
        if name == self._phase:
            return
        self._phase = name
        self.emit("phase", phase=name)

    def close(self) -> None:
        """Close the descriptor (every event is already durable)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Return the events of a file, skipping a torn last line if any."""
    events = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
