"""A real gateway process (`python -m gateway serve`) on the real dev cluster, for tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from sqlmodel import Session

from gateway.access.tokens import create_token
from gateway.db import make_engine, migrate
from gateway.models import Role
from gateway.services.tenants import ensure_tenant
from gateway.slurm import LocalRunner
from gateway.storage.onboarding import TenantAdmin

ROOT = Path(__file__).resolve().parents[2]
STORAGE = Path("/srv/slurm-finetune")
MODEL = "tiny-chat"
FAST_HP = {"n_epochs": 1, "batch_size_tokens": 512, "max_seq_len": 256, "checkpoint_every_steps": 3,
           "learning_rate_multiplier": 10}


def ensure_tiny_model(name: str = MODEL) -> None:
    """Register the tiny model as ``name`` unless the catalog has it (a catalog kept from an older
    checkout keeps its ``tiny-chat``: a test that needs today's build registers it under a name of
    its own, e.g. ``tiny-tools``)."""
    from trainer import catalog

    root = STORAGE / "models"
    if not any(e.name == name for e in catalog.list_models(root)):
        with tempfile.TemporaryDirectory() as tmp:
            catalog.add(catalog.make_tiny(Path(tmp) / "tiny"), name, root)


def chat_file(path: Path, n: int, seed: int = 0) -> Path:
    from trainer.toydata import toy_conversations

    path.write_text("".join(json.dumps(r) + "\n" for r in toy_conversations(n, seed=seed)))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveGateway:
    """Onboards tenants (Slurm + unix + DB), mints tokens, runs `gateway serve`."""

    def __init__(self, workdir: Path, tenants: tuple[str, ...], db_url: str | None = None, **env: str):
        ensure_tiny_model()
        from gateway.cli.privsep import service_owned_dir
        from gateway.config import Settings

        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the gateway drops to its service user: its SQLite file lives in a dir that user owns
        self.db_dir = service_owned_dir(Settings(), f"test-{workdir.name}-{self.port}")
        self.db_url = db_url or f"sqlite:///{self.db_dir / 'gw.db'}"
        self.env = {**os.environ, "SFT_DATABASE_URL": self.db_url, "SFT_RECONCILE_INTERVAL_S": "0.5",
                    "SFT_AUDIT_KEY_FILE": str(self.db_dir / "audit.key"),   # one anchor per test database
                    "SFT_CANCEL_DEADLINE_S": "10", "SFT_CREDENTIALS_FILE": str(workdir / "cred.json"),
                    **env}
        admin = TenantAdmin(LocalRunner(), storage_root=STORAGE)
        engine = make_engine(self.db_url)
        migrate(engine)
        from gateway.access import audit

        audit.use_key_file(engine, self.db_dir / "audit.key")
        self.tokens: dict[str, str] = {}
        with Session(engine) as s:
            for t in tenants:
                admin.add_tenant(t, shares=5, qos=["ft-small", "ft-standard"])
                self.tokens[t], _ = create_token(session=s, role=Role.MEMBER, tenant=ensure_tenant(session=s, name=t))
            s.commit()
        self.engine = engine
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.log = open(self.workdir / f"serve-{self.port}.log", "ab")  # noqa: SIM115
        # from the runtime's installed copy (cwd outside the checkout): after dropping to its service
        # user the gateway may not be able to read the checkout (CI clones under root's home)
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(self.port),
                                      "--log-level", "warning"], cwd="/", env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, (self.workdir / f"serve-{self.port}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.2)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)
        self.engine.dispose()

    # -- HTTP helpers
    def h(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[tenant]}"}

    def api(self, method: str, path: str, tenant: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={**self.h(tenant), **kw.pop("headers", {})},
                             timeout=60, **kw)

    def upload(self, tenant: str, path: Path) -> str:
        with open(path, "rb") as f:
            r = self.api("POST", "/v1/files", tenant, data={"purpose": "fine-tune"},
                         files={"file": (path.name, f)})
        assert r.status_code == 200 and r.json()["status"] == "processed", r.text
        return str(r.json()["id"])

    def create(self, tenant: str, file_id: str, hp: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        r = self.api("POST", "/v1/fine_tuning/jobs", tenant,
                     json={"model": MODEL, "training_file": file_id, "hyperparameters": hp or FAST_HP, **kw})
        assert r.status_code == 200, r.text
        return dict(r.json())

    def job(self, tenant: str, job_id: str) -> dict[str, Any]:
        r = self.api("GET", f"/v1/fine_tuning/jobs/{job_id}", tenant)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def wait(self, tenant: str, job_id: str, ok: Callable[[dict[str, Any]], bool],
             timeout: float = 240) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            j = self.job(tenant, job_id)
            if ok(j):
                return j
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {j['status']} ({j.get('phase')}, error {j['error']}) "
                                     f"after {timeout}s")
            time.sleep(0.5)

    def kept_checkpoints(self, tenant: str, job_id: str, timeout: float = 60) -> list[dict[str, Any]]:
        """The checkpoints of ``job_id`` (ended unpublished) once the gateway has made the complete ones
        adapters (its event says so, or that none is complete), highest step first; at once if it has none."""
        deadline = time.monotonic() + timeout
        while True:
            cks = self.api("GET", f"/v1/fine_tuning/jobs/{job_id}/checkpoints?limit=100", tenant).json()["data"]
            events = self.api("GET", f"/v1/fine_tuning/jobs/{job_id}/events?limit=100", tenant).json()["data"]
            if not cks or any("continued from" in e["message"] for e in events):
                return list(cks)
            assert time.monotonic() < deadline, f"job {job_id}: its checkpoints were not published: {cks}"
            time.sleep(0.5)


def terminal(j: dict[str, Any]) -> bool:
    return j["status"] in ("succeeded", "failed", "cancelled")
