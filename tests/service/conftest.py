"""Service tier: the gateway on a real database (SQLite file and a real PostgreSQL server).

PostgreSQL: a throwaway server is started once per session (initdb + pg_ctl as the
``postgres`` user, trust auth on 127.0.0.1, a private socket dir). Each test gets a
fresh schema. Set SFT_TEST_PG_URL to use an existing server instead.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlmodel import Session

from gateway.access.tokens import create_token
from gateway.app import create_app
from gateway.config import Settings
from gateway.db import make_engine, migrate
from gateway.models import Role
from gateway.services.tenants import ensure_tenant

TENANT_A, TENANT_B = "svc-a", "svc-b"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def pg_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("SFT_TEST_PG_URL"):
        yield os.environ["SFT_TEST_PG_URL"]
        return
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not bins or os.geteuid() != 0:
        pytest.skip("PostgreSQL backend skipped: needs root and Debian's postgresql package")
    bindir = Path(bins[-1]).parent
    base = Path(tempfile.mkdtemp(prefix="sft-pg-"))   # pytest's tmp is 0700 root: not for postgres
    shutil.chown(base, "postgres", "postgres")
    data, sock, port = base / "data", base / "sock", _free_port()
    sock.mkdir()
    shutil.chown(sock, "postgres", "postgres")

    def as_pg(*argv: str) -> None:
        res = subprocess.run(["runuser", "-u", "postgres", "--", *argv], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {res.stderr or res.stdout}")

    as_pg(str(bindir / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres", "-E", "UTF8")
    as_pg(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(base / "log"), "-w", "start", "-o",
          f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off")
    try:
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        yield url
    finally:
        as_pg(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gateway.db'}"
    url: str = request.getfixturevalue("pg_url")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA public CASCADE"))
        conn.execute(sa.text("CREATE SCHEMA public"))
    engine.dispose()
    return url


def ensure_unix_user(name: str) -> None:
    """Tenant files must be owned by the tenant's unix user: create it (root only) and record it
    as `finetune admin tenant add` does, or the broker will not act as it."""
    from gateway.storage import identities

    if os.geteuid() != 0:
        return
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        name], check=True)
    pw = pwd.getpwnam(name)
    if identities.read().get(name) != identities.Entry(name, pw.pw_uid, pw.pw_gid):
        identities.record(identities.Entry(name, pw.pw_uid, pw.pw_gid))


def tenant_storage_root() -> Iterator[Path]:
    """A storage root tenants can traverse (pytest's tmp is under root's 0700 dir): the storage
    broker opens it as each tenant's uid, exactly as on a real cluster."""
    root = Path(tempfile.mkdtemp(prefix="sft-svc-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def onboard_storage(root: Path, *tenants: str) -> None:
    """What `finetune admin tenant add` does for storage: tenants/ 0711, each root 0700 owned."""
    from gateway.storage import create_tenant_root

    for name in tenants:
        ensure_unix_user(f"sft-{name}")
        if os.geteuid() == 0:
            pw = pwd.getpwnam(f"sft-{name}")
            create_tenant_root(root, name, pw.pw_uid, pw.pw_gid)


@pytest.fixture
def storage_root() -> Iterator[Path]:
    yield from tenant_storage_root()


@pytest.fixture
def settings(db_url: str, storage_root: Path) -> Settings:
    return Settings(storage_root=storage_root, database_url=db_url, default_model=None,
                    max_upload_bytes=8 * 1024 * 1024, max_line_bytes=1024 * 1024)


class Gateway:
    """The app plus a token per tenant."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.app = create_app(settings)
        self.client = TestClient(self.app, raise_server_exceptions=False)
        self.tokens: dict[str, str] = {}
        onboard_storage(settings.storage_root, TENANT_A, TENANT_B)
        with Session(self.app.state.engine) as session:
            for name in (TENANT_A, TENANT_B):
                tenant = ensure_tenant(session=session, name=name)
                self.tokens[name], _ = create_token(session=session, role=Role.MEMBER, tenant=tenant)
            self.tokens["sysadmin"], _ = create_token(session=session, role=Role.SYSADMIN, tenant=None)
            session.commit()

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def upload(self, who: str, content: bytes, filename: str = "train.jsonl",
               purpose: str = "fine-tune", **kw: object):  # type: ignore[no-untyped-def]
        return self.client.post("/v1/files", headers=self.auth(who),
                                data={"purpose": purpose},
                                files={"file": (filename, content, "application/jsonl")}, **kw)


@pytest.fixture
def gw(settings: Settings) -> Iterator[Gateway]:
    g = Gateway(settings)
    yield g
    g.app.state.engine.dispose()


class RecordingSubmitter:
    """``jobcreate.Submit`` without Slurm, for tests about what create admits, records and shows: keeps
    each spec it is given and answers the next fake Slurm id under QOS ft-small."""

    def __init__(self) -> None:
        self.specs: dict[str, Any] = {}

    def __call__(self, job: Any, spec: Any, tenant: str) -> tuple[int, str]:
        self.specs[job.id] = spec
        return 1000 + len(self.specs), "ft-small"

    def qos_for(self, tenant: str, minutes: int, gpus: int = 1) -> str:
        return "ft-small"


def cli_over(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``run(token, *args) -> (exit code, output)``: the real `finetune` CLI, its HTTP calls served
    by ``gw``'s in-process app."""
    import httpx
    from click.testing import CliRunner

    from gateway.cli import main
    from gateway.config import get_settings

    def request(method: str, url: str, **kw: Any) -> httpx.Response:
        kw.pop("timeout", None)
        return gw.client.request(method, url, **kw)

    monkeypatch.setattr(httpx, "request", request)

    def run(token: str, *args: str) -> tuple[int, str]:
        get_settings.cache_clear()
        try:
            res = CliRunner().invoke(main, list(args), env={"SFT_API_URL": "http://testserver",
                                                            "SFT_API_TOKEN": token})
        finally:
            get_settings.cache_clear()
        return res.exit_code, res.output

    return run


def chat_lines(n: int, start: int = 0) -> bytes:
    import json

    rows = [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]}
            for i in range(start, start + n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on {port} after {timeout}s")
        time.sleep(0.1)


__all__ = ["Gateway", "chat_lines", "migrate", "wait_port"]


@pytest.fixture(scope="session")
def tiny_catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A catalog holding only the tiny model as tiny-chat (models add, its checks included)."""
    from trainer import catalog

    root = tmp_path_factory.mktemp("models")
    catalog.add(catalog.make_tiny(tmp_path_factory.mktemp("tiny") / "m"), "tiny-chat", root)
    return root
