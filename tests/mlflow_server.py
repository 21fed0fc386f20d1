"""A real MLflow tracking server for tests (``mlflow server`` on loopback, a SQLite backend), from its own
venv (``$SFT_RUNTIME_PREFIX/mlflow-venv``, made by scripts/test-mlflow.sh: MLflow pins many packages, so it
stays out of the product's venv), and a reader that asks it back with MLflow's own client in that venv."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

VENV = Path(os.environ.get("SFT_RUNTIME_PREFIX", "/opt/slurm-finetune")) / "mlflow-venv"
PY = VENV / "bin" / "python"

READ = """
import json, sys
from mlflow.tracking import MlflowClient
uri, run_ids, keys = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
c = MlflowClient(tracking_uri=uri)
out = {}
for run_id in run_ids:
    run = c.get_run(run_id)
    out[run_id] = {
        "status": run.info.status, "end_time": run.info.end_time, "run_name": run.info.run_name,
        "experiment": c.get_experiment(run.info.experiment_id).name,
        "params": run.data.params, "tags": run.data.tags,
        "metrics": {k: [[m.step, m.value, m.timestamp] for m in c.get_metric_history(run_id, k)] for k in keys},
    }
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 (a free port, kept across ``stop``/``start``); skips the test when
    the MLflow venv is missing."""

    def __init__(self, workdir: Path):
        if not (VENV / "bin" / "mlflow").exists():
            pytest.skip(f"no MLflow at {VENV}: run scripts/test-mlflow.sh (scripts/test.sh does, as root)")
        self.workdir, self.port = workdir, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (not waiting: ``wait_up``)."""
        log = open(self.workdir / "mlflow-server.log", "ab")  # noqa: SIM115
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}   # no job runner: starts in ~8 s
        self.proc = subprocess.Popen(
            [str(VENV / "bin" / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{self.workdir / 'mlflow.db'}",
             "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, timeout: float = 90) -> float:
        """Seconds until it answered /health; fails the test after ``timeout``."""
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, (self.workdir / "mlflow-server.log").read_text()[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"mlflow server not up after {timeout}s")

    def stop(self) -> None:
        """Stop it and every process it started (its session's group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    def read_runs(self, run_ids: list[str], metrics: list[str]) -> dict[str, dict[str, Any]]:
        """Each run as MLflow's client reads it (one process for all): status, end time, name, experiment,
        params, tags, and the history of each of ``metrics`` ([step, value, timestamp ms] each), by run id."""
        out = subprocess.run([str(PY), "-c", READ, self.url, ",".join(run_ids), ",".join(metrics)],
                             capture_output=True, text=True, timeout=120, check=True,
                             env={**os.environ, "MLFLOW_TRACKING_URI": self.url})
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
