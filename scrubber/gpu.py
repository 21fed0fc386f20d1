"""The job's physical GPUs: device files (gres.conf), NVML observations, the memory wipe.

Without an NVIDIA driver (NVML cannot initialise) every NVML observation is
``None`` and the GPU steps report ``skipped: no driver``: never a success that
did not happen. The wipe needs torch with CUDA in the runtime venv; a driver
without it is a failure (the node cannot be scrubbed), not a skip.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_GRES_LINE = re.compile(r"\bName=gpu\b")
_BRACKET = re.compile(r"^(?P<prefix>.*)\[(?P<ranges>[^\]]+)\](?P<suffix>.*)$")

NO_DRIVER = "no driver"


# ---------------------------------------------------------------- device files
def expand_hostlist(expr: str) -> list[str]:
    """``/dev/nvidia[0-1,3]`` → ``['/dev/nvidia0', '/dev/nvidia1', '/dev/nvidia3']``."""
    m = _BRACKET.match(expr)
    if not m:
        return [expr]
    out = []
    for part in m["ranges"].split(","):
        lo, _, hi = part.partition("-")
        width = len(lo)
        for i in range(int(lo), int(hi or lo) + 1):
            out.append(f"{m['prefix']}{i:0{width}d}{m['suffix']}")
    return out


def node_gpu_files(gres_conf: str, node: str) -> list[str]:
    """Device files of ``node``'s GPUs in gres.conf order (SLURM_JOB_GPUS indexes this list)."""
    files: list[str] = []
    for raw in gres_conf.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not _GRES_LINE.search(line):
            continue
        kv = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        names = kv.get("NodeName")
        if names is not None and node not in expand_hostlist(names):
            continue
        if "File" in kv:
            files += expand_hostlist(kv["File"])
    return files


def job_gpu_files(gres_conf: str, node: str, indices: Sequence[int]) -> list[str]:
    """The job's device files; identity (/dev/nvidia<i>) where gres.conf lists none."""
    files = node_gpu_files(gres_conf, node)
    return [files[i] if i < len(files) else f"/dev/nvidia{i}" for i in indices]


def read_gres_conf(path: Path) -> str:
    """The text of gres.conf; "" when the file does not exist."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def device_minor(path: str) -> int | None:
    """The minor device number of the device file ``path``; None when it cannot be stat'ed."""
    try:
        return os.minor(os.stat(path).st_rdev)
    except OSError:
        return None


# ------------------------------------------------------------------------- NVML
@dataclass(frozen=True)
class GpuInfo:
    minor: int
    uuid: str
    total: int
    used: int  # v2 memory info where available: excludes driver-reserved memory
    compute_pids: tuple[int, ...]


def nvml() -> Any | None:
    """The initialised pynvml module, or None when there is no driver (or no pynvml)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


def gpu_info(minors: Sequence[int]) -> dict[int, GpuInfo] | None:
    """NVML view of these GPUs (by device-file minor number); None without a driver."""
    nv = nvml()
    if nv is None:
        return None
    try:
        out = {}
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            minor = nv.nvmlDeviceGetMinorNumber(h)
            if minor in minors:
                out[minor] = _info(nv, h, minor)
        return out
    finally:
        nv.nvmlShutdown()


def _info(nv: Any, h: Any, minor: int) -> GpuInfo:
    try:
        mem = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
    except (AttributeError, TypeError, nv.NVMLError):
        mem = nv.nvmlDeviceGetMemoryInfo(h)
    procs = list(nv.nvmlDeviceGetComputeRunningProcesses(h))
    try:
        procs += list(nv.nvmlDeviceGetGraphicsRunningProcesses(h))
    except nv.NVMLError:
        pass
    uuid = nv.nvmlDeviceGetUUID(h)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    return GpuInfo(minor, uuid, int(mem.total), int(mem.used), tuple(sorted({p.pid for p in procs})))


# ------------------------------------------------------------------------- wipe
@dataclass(frozen=True)
class WipeResult:
    device: str  # the GPU's UUID
    total_bytes: int
    free_bytes: int  # free on the device just before the wipe (cudaMemGetInfo, our context made)
    wiped_bytes: int  # allocated, zeroed and verified
    nonzero_chunks: int  # chunks still holding a non-zero byte after the wipe (must be 0)
    seconds: float

    @property
    def gb_per_s(self) -> float:
        """Wipe throughput in GB/s (10^9 bytes); 0 when no time was measured."""
        return self.wiped_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def fraction(self) -> float:
        """Share of the free memory the wipe zeroed and verified (0 when nothing was free)."""
        return self.wiped_bytes / self.free_bytes if self.free_bytes > 0 else 0.0


def import_torch_cuda(uuids: Sequence[str]) -> Any | None:
    """torch with exactly these GPUs visible (by UUID), or None when torch/CUDA is missing.

    CUDA reads CUDA_VISIBLE_DEVICES once, at initialisation: it must be set before
    torch touches CUDA, and UUIDs avoid any ordering mismatch with NVML.
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(uuids)
    try:
        import torch  # lazy: torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def fill(torch: Any, index: int, value: int, *, chunk_bytes: int = 1 << 30,
         min_chunk_bytes: int = 2 << 20) -> list[Any]:
    """Allocate all free memory of CUDA device ``index`` in chunks, every byte set to ``value``.

    Returns the chunks (the caller frees them). Chunks halve on OOM down to
    ``min_chunk_bytes`` so the last scraps are taken too.
    """
    dev = torch.device("cuda", index)
    chunks: list[Any] = []
    size = chunk_bytes
    while size >= min_chunk_bytes:
        try:
            t = torch.empty(size, dtype=torch.uint8, device=dev)
        except torch.cuda.OutOfMemoryError:
            size //= 2
            continue
        t.fill_(value)
        chunks.append(t)
    torch.cuda.synchronize(dev)
    return chunks


def count_nonzero_chunks(torch: Any, chunks: list[Any]) -> int:
    """How many chunks hold a non-zero byte. Frees the smallest chunk first (checked on the
    host) so the reductions have room: the device is otherwise full."""
    bad = 0
    if chunks:
        last = chunks.pop()
        bad += int(bool(last.cpu().any()))
        del last
    for t in chunks:
        bad += int(bool(t.any().item()))  # a reduction: no full-size temporary
    return bad


def wipe_gpu(torch: Any, index: int, *, chunk_bytes: int, min_chunk_bytes: int) -> WipeResult:
    """Zero and verify all memory of CUDA device ``index`` a new context can allocate.

    The memory free just before (after this process's CUDA context exists) is
    measured too: the judge wants nearly all of it wiped, not just some bytes.
    """
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", index))
    t0 = time.perf_counter()
    free, _ = torch.cuda.mem_get_info(index)
    chunks = fill(torch, index, 0, chunk_bytes=chunk_bytes, min_chunk_bytes=min_chunk_bytes)
    filled = sum(t.numel() for t in chunks)
    bad = count_nonzero_chunks(torch, chunks)
    chunks.clear()
    torch.cuda.empty_cache()
    return WipeResult(uuid, int(props.total_memory), int(free), filled, bad, time.perf_counter() - t0)
