"""The one place the trainer reads the job environment (``SLURM_*``, ranks, ``CUDA_VISIBLE_DEVICES``, and
the test suite's fault injection, ``test_fault_step``)."""

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


TEST_TIER_VARIABLE = "SFT_TEST_TIER"
FAULT_VARIABLE = "SFT_TEST_FAULT_LR_BLOWUP_AT_STEP"


def test_fault_step() -> int | None:
    """The optimizer step the test suite's learning-rate blow-up is injected at, or None.

    Fault injection for tests only, kept out of the job spec (which holds only what a user may
    ask: a spec naming it is refused): that step runs at learning rate 1e30, so the weights
    overflow and the next step's loss is not finite (``DivergedError``). Read only when
    ``SFT_TEST_TIER`` is set too, so a stray ``SFT_TEST_FAULT_LR_BLOWUP_AT_STEP`` alone does
    nothing. A job's environment is the gateway's to write (``sbatch --export=NONE``: only the
    batch script's exports reach it), so a tenant's request cannot set either; the test suite
    gets both into a job through the gateway's ``SFT_TEST_JOB_ENV`` (``gateway.config``), or
    into a trainer it starts itself through that process's environment.

    Raises:
        ValueError: the tier is set and the step is not a positive integer.
    """
    if not os.environ.get(TEST_TIER_VARIABLE) or not os.environ.get(FAULT_VARIABLE):
        return None
    step = int(os.environ[FAULT_VARIABLE])
    if step < 1:
        raise ValueError(f"{FAULT_VARIABLE} must be >= 1, got {step}")
    return step


_TORCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_SLURM_NAMES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
TIMEOUT_VARIABLE = "SFT_DIST_TIMEOUT_S"
"""Overrides the collective timeout (seconds) of a data-parallel run (tests, slow shared filesystems)."""


def world_env() -> tuple[int, int, int, str]:
    """Return ``(rank, world size, local rank, source)`` of this process in its data-parallel run.

    From ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` when ``WORLD_SIZE`` is set, else from
    Slurm's ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (one srun task per GPU),
    else ``(0, 1, 0)``. ``source`` names the size's variable, for error messages. With one
    rank a missing rank or local rank is 0 (a batch script without srun sets only some).

    Raises:
        ValueError: a value is not an integer, the size is < 1, the rank is outside
            ``[0, size)``, the local rank is < 0, or a rank variable of a run of several is unset.
    """
    names = _TORCH_NAMES if "WORLD_SIZE" in os.environ else _SLURM_NAMES
    if names[1] not in os.environ:
        return 0, 1, 0, "neither WORLD_SIZE nor SLURM_NTASKS is set"
    size = _integer(names[1], None)
    if size < 1:
        raise ValueError(f"{names[1]} must be >= 1, got {size}")
    default = 0 if size == 1 else None
    rank, local_rank = _integer(names[0], default), _integer(names[2], default)
    if not 0 <= rank < size:
        raise ValueError(f"{names[0]} must be in [0, {size}) ({names[1]}={size}), got {rank}")
    if local_rank < 0:
        raise ValueError(f"{names[2]} must be >= 0, got {local_rank}")
    return rank, size, local_rank, names[1]


def _integer(name: str, default: int | None) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        if default is None:
            raise ValueError(f"{name} is not set: every rank of a run of several needs it")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw[:40]!r}") from None


def dist_timeout_s(default: float) -> float:
    """Return the collective timeout in seconds: ``SFT_DIST_TIMEOUT_S`` when set, else ``default``.

    Raises:
        ValueError: the variable is set but is not a positive number.
    """
    raw = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_VARIABLE} must be a number of seconds, got {raw[:40]!r}") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_VARIABLE} must be > 0, got {value}")
    return value


def rendezvous_missing() -> list[str]:
    """Return which of ``MASTER_ADDR``/``MASTER_PORT`` (rank 0's address, read by torch's ``env://``) are unset."""
    return [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name, "").strip()]
