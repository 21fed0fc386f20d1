"""The one place the trainer reads the job environment (``SLURM_*``, ``CUDA_VISIBLE_DEVICES``)."""

from __future__ import annotations

import os
from pathlib import Path

NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")
"""Present when the NVIDIA kernel driver is loaded (absent for the dev cluster's mknod'ed fake GPUs)."""


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


def gpu_environment() -> str:
    """Describe the GPU allocation Slurm gave this job, for error messages (node, visible devices)."""
    node = os.environ.get("SLURMD_NODENAME")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f"node {node}; " if node else ""
    return where + (f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES is unset")


def real_gpu_allocated(driver: Path = NVIDIA_DRIVER) -> bool:
    """Whether Slurm gave this job a GPU on a node whose NVIDIA driver is loaded.

    ``CUDA_VISIBLE_DEVICES`` names at least one device and the driver is there: a
    GPU really was promised, so training on the CPU instead would be a silent
    fallback. The dev cluster's fake GPUs (device nodes without a driver) are not.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return bool(visible) and visible not in ("-1", "NoDevFiles") and driver.exists()
