"""The one place the trainer reads the job environment (``SLURM_*``)."""

from __future__ import annotations

import os


def attempt_number() -> int:
    """Return the attempt number: Slurm's ``SLURM_RESTART_COUNT``, 0 when unset.

    Raises:
        ValueError: the variable is set but is not a non-negative integer.
    """
    raw = os.environ.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    value = int(raw)
    if value < 0:
        raise ValueError(f"SLURM_RESTART_COUNT must be >= 0, got {value}")
    return value
