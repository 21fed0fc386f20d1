"""Catch SIGUSR1/SIGTERM from the first instant of ``python -m trainer``.

Importing torch and friends takes seconds; without this, a signal in that
window would kill the process with the default action (SIGUSR1: exit 138,
not a requeue). ``capture`` records them; ``StopFlag.install`` replays them.
Stdlib only, and never installed when ``trainer`` is merely imported.
"""

from __future__ import annotations

import signal
from types import FrameType

_pending: list[int] = []


def _remember(signum: int, frame: FrameType | None) -> None:
    _pending.append(signum)


def capture() -> None:
    """Record SIGUSR1/SIGTERM until the real handlers are installed."""
    signal.signal(signal.SIGUSR1, _remember)
    signal.signal(signal.SIGTERM, _remember)


def pending() -> list[int]:
    """Return (and forget) the signals received so far."""
    received = list(_pending)
    _pending.clear()
    return received
