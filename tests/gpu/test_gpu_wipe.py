"""The epilog's GPU wipe on a real GPU: what one process left in GPU memory is unreadable
to the next one.

Process A fills all free memory of the GPU with a high-entropy pattern (random int64
words, every 512th the run's 64-bit canary marker) and is SIGKILLed while holding it.
Then the real epilog runs (``python -m scrubber epilog``, job GPU = that GPU). Process B
then allocates (uninitialised) all the memory it can and scans every byte: zero canary
hits. Also: the wipe's bandwidth next to the GPU's device-to-device copy bandwidth.
Skipped without CUDA (torch) and NVML.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scrubber import canary

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
GPU_INDEX = int(os.environ.get("SFT_TEST_GPU", "0"))
NOBODY_UID = 59_998  # the fake job user: owns no process or file, so the epilog kills nothing


def _gpu_problem() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - any NVML failure means: no driver to test against
        return f"NVML unavailable ({type(e).__name__}): no NVIDIA driver"
    return None


@pytest.fixture(scope="module")
def gpu() -> int:
    problem = _gpu_problem()
    if problem:
        pytest.skip(f"gpu tier skipped: {problem}")
    return GPU_INDEX


BANDWIDTH = """
    import time, torch
    a = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    torch.cuda.synchronize()
    print(5 * 2 * a.numel() / (time.perf_counter() - t0) / 1e9)
"""


def _visible(gpu: int) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": str(gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def _epilog(gpu: int, tmp: Path) -> dict:
    env = {"SLURM_JOB_ID": "990001", "SLURM_JOB_UID": str(NOBODY_UID), "SLURM_JOB_GPUS": str(gpu),
           "SLURMD_NODENAME": "gputest", "PATH": os.environ.get("PATH", "")}
    t0 = time.perf_counter()
    res = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "scrubber", "epilog", "--config", str(tmp / "absent.toml"),
         "--scratch-root", str(tmp / "scratch"), "--report-dir", str(tmp / "reports"),
         "--log-dir", str(tmp)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    report = json.loads((tmp / "reports" / "gputest" / "990001-epilog.json").read_text())
    report["wall_s"] = time.perf_counter() - t0
    assert res.returncode == 0, (res.stdout, res.stderr, report)
    return report


def test_wipe_leaves_no_canary_for_the_next_process(gpu: int, tmp_path: Path) -> None:
    marker = secrets.token_hex(8)
    a = subprocess.Popen([sys.executable, "-c", textwrap.dedent(canary.FILL), marker],  # noqa: S603
                         text=True, stdout=subprocess.PIPE, env={**os.environ, **_visible(gpu)}, cwd=REPO)
    try:
        assert a.stdout is not None
        filled = int(a.stdout.readline().split()[0])
        assert filled > 1 << 30, "process A could not fill the GPU"
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=60)

    report = _epilog(gpu, tmp_path)
    wipe = next(s for s in report["steps"] if s["name"] == "gpu_wipe")
    assert wipe["status"] == "ok", wipe
    assert wipe["figures"]["gpu_bytes_wiped"] >= 0.9 * filled, (wipe, filled)
    assert wipe["figures"]["gpu_wipe_fraction"] >= 0.99, wipe  # of the memory free before the wipe
    assert next(s for s in report["steps"] if s["name"] == "gpu_processes")["status"] == "ok"

    b = subprocess.run([sys.executable, "-c", textwrap.dedent(canary.SCAN), marker],  # noqa: S603
                       env={**os.environ, **_visible(gpu)}, cwd=REPO, capture_output=True,
                       text=True, timeout=600, check=True)
    hits, scanned = map(int, b.stdout.split())
    assert scanned >= 0.9 * filled, (scanned, filled)
    assert hits == 0, f"{hits} canary words readable after the wipe"

    bw = subprocess.run([sys.executable, "-c", textwrap.dedent(BANDWIDTH)],  # noqa: S603
                        env={**os.environ, **_visible(gpu)}, capture_output=True, text=True,
                        timeout=300, check=True)
    copy_gbs = float(bw.stdout.strip())
    wipe_gbs = wipe["figures"]["wipe_gb_per_s"]
    print(f"GPU {gpu}: A filled {filled / 1e9:.1f} GB; wiped {wipe['figures']['gpu_bytes_wiped'] / 1e9:.1f} GB "
          f"({wipe['figures']['gpu_wipe_fraction']:.2%} of the free memory) "
          f"in {wipe['figures']['wipe_seconds']:.2f} s = {wipe_gbs:.0f} GB/s (zero + verify) vs "
          f"device copy {copy_gbs:.0f} GB/s (read+write) = {wipe_gbs / copy_gbs:.2f}x; "
          f"epilog wall {report['wall_s']:.1f} s; B scanned {scanned / 1e9:.1f} GB: {hits} hits")
    assert wipe_gbs >= 0.05 * copy_gbs, "the wipe is far slower than the GPU's memory bandwidth"
