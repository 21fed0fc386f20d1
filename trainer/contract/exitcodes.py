"""Exit codes of ``python -m trainer run`` (the contract with the sbatch template).

The gateway reads them through sacct's ExitCode; the sbatch template turns
``REQUEUE`` into ``scontrol requeue``.
"""

from __future__ import annotations

OK = 0
"""Training finished; ``attempts/<n>/staging/COMPLETE`` exists."""

INTERNAL = 1
"""Unexpected failure (a bug, CUDA error, out of memory...): FAILED(internal)."""

USER_ERROR = 65
"""EX_DATAERR: invalid spec or dataset (wrong sha256, bad line, example too long)."""

MODEL_ERROR = 78
"""EX_CONFIG: base model missing from the catalog or its digest differs from the spec."""

GPU_UNAVAILABLE = 69
"""EX_UNAVAILABLE: the spec says ``device: "cuda"`` but CUDA is not usable on this node (refused before loading)."""

PEER_LOST = 76
"""EX_PROTOCOL: a collective with the other ranks failed (one died or timed out): the gang's batch
script requeues the job (a bounded number of times) and the next attempt resumes."""

REQUEUE = 75
"""EX_TEMPFAIL: SIGUSR1 (time limit near) -> checkpoint written, requeue me."""

CANCELLED = 143
"""128 + SIGTERM: cancelled; stopped within one step; never writes COMPLETE."""
