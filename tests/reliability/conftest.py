"""Fixtures for the reliability suite: a real HTTP server around the app (in-process
uvicorn, so the CLI and raw sockets hit it), the real cluster, and fault helpers
that always put the dev cluster back."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.slurm.conftest import _cluster_problem

FINETUNE = "/opt/slurm-finetune/venv/bin/finetune"
PIDS = Path("/var/lib/slurm-finetune/devcluster/pids.json")


@pytest.fixture(scope="session")
def cluster() -> None:
    problem = _cluster_problem()
    if problem:
        pytest.skip(f"slurm tier skipped: {problem}")


class Served:
    """``app`` behind a real uvicorn server on 127.0.0.1 (a thread of this process)."""

    def __init__(self, app: Any):
        import uvicorn

        from tests.service.conftest import _free_port

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(10)


def vm_rss_mb(pid: int) -> float:
    """Resident memory of a process now (VmRSS), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def daemon_pid(name: str) -> int:
    import json

    return int(json.loads(PIDS.read_text())[name])


def cluster_up() -> None:
    """`finetune dev-cluster up`: restarts whichever daemon is dead (idempotent)."""
    subprocess.run([FINETUNE, "dev-cluster", "up"], check=True, capture_output=True, timeout=300)


def wait_dead(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return
        except OSError:
            return
        assert time.monotonic() < deadline, f"process {pid} still alive"
        time.sleep(0.1)


def kill_daemon(name: str, sig: int) -> int:
    pid = daemon_pid(name)
    os.kill(pid, sig)
    wait_dead(pid)
    return pid


def scancel_tenants(*tenants: str) -> None:
    """Stop every Slurm job of these (test-only) tenants: a test's DB dies with it, its jobs must too."""
    for t in tenants:
        subprocess.run(["scancel", "-u", f"sft-{t}"], capture_output=True, timeout=60)


@pytest.fixture
def restore_cluster() -> Iterator[None]:
    """Whatever a fault test stopped is started again, pass or fail."""
    try:
        yield
    finally:
        cluster_up()
