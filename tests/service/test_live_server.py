"""The gateway as operators run it (`finetune serve`), driven by the official openai
client, by our CLI, and by a 300 MB upload over the 256 MB limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session

from gateway.db import make_engine, migrate
from gateway.services.tenants import ensure_tenant
from tests.service.conftest import (
    TENANT_A,
    TENANT_B,
    _free_port,
    chat_lines,
    onboard_storage,
    tenant_storage_root,
    wait_port,
)

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parents[2]
DATASETS = ROOT / "tests" / "data" / "datasets"
LIMIT = 256 * 1024 * 1024


class Live:
    def __init__(self, tmp: Path, storage: Path):
        from gateway.cli.privsep import service_owned_dir
        from gateway.config import Settings

        self.storage = storage
        onboard_storage(storage, TENANT_A, TENANT_B)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        db_dir = service_owned_dir(Settings(), f"test-live-{self.port}")
        self.env = {**os.environ, "SFT_DATABASE_URL": f"sqlite:///{db_dir / 'gw.db'}",
                    "SFT_STORAGE_ROOT": str(self.storage), "SFT_DEFAULT_MODEL": "",
                    "SFT_MAX_UPLOAD_BYTES": str(LIMIT), "SFT_CREDENTIALS_FILE": str(tmp / "cred.json")}
        engine = make_engine(self.env["SFT_DATABASE_URL"])
        migrate(engine)
        with Session(engine) as s:
            for t in (TENANT_A, TENANT_B):
                ensure_tenant(session=s, name=t)
            s.commit()
        engine.dispose()
        self.tokens = {t: self.cli("admin", "token", "create", "--tenant", t, "--json").json()["token"]
                       for t in (TENANT_A, TENANT_B)}
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(self.port),
                                      "--log-level", "warning"], cwd="/", env=self.env)
        wait_port(self.port)

    def cli(self, *args: str, token: str | None = None, check: bool = True) -> CliResult:
        env = {**self.env, "SFT_API_URL": self.url, **({"SFT_API_TOKEN": token} if token else {})}
        res = subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
        if check and res.returncode != 0:
            raise AssertionError(f"finetune {' '.join(args)} failed: {res.stderr}")
        return CliResult(res.returncode, res.stdout, res.stderr)

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM")


class CliResult:
    def __init__(self, rc: int, out: str, err: str):
        self.rc, self.out, self.err = rc, out, err

    def json(self):  # type: ignore[no-untyped-def]
        return json.loads(self.out)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("live")
    os.chmod(tmp, 0o755)
    for storage in tenant_storage_root():
        server = Live(tmp, storage)
        yield server
        server.proc.terminate()
        server.proc.wait(10)


def test_official_openai_client(live: Live, tmp_path: Path) -> None:
    from openai import OpenAI

    path = tmp_path / "train.jsonl"
    path.write_bytes(chat_lines(25))
    client = OpenAI(base_url=live.url + "/v1", api_key=live.tokens[TENANT_A], max_retries=0)
    with open(path, "rb") as f:
        created = client.files.create(file=f, purpose="fine-tune")
    assert created.id.startswith("file-") and created.status == "processed"
    assert created.bytes == path.stat().st_size and created.filename == "train.jsonl"
    assert created.id in [f.id for f in client.files.list()]
    assert client.files.retrieve(created.id).id == created.id
    assert client.files.content(created.id).read() == path.read_bytes()
    other = OpenAI(base_url=live.url + "/v1", api_key=live.tokens[TENANT_B], max_retries=0)
    assert created.id not in [f.id for f in other.files.list()]
    from openai import NotFoundError

    with pytest.raises(NotFoundError):
        other.files.retrieve(created.id)


def test_cli_upload_list_show_rm(live: Live, tmp_path: Path) -> None:
    tok = live.tokens[TENANT_A]
    good = tmp_path / "good.jsonl"
    good.write_bytes(chat_lines(15, start=1000))
    up = live.cli("files", "upload", str(good), "--json", token=tok).json()
    assert up["status"] == "processed"
    text = live.cli("files", "upload", str(DATASETS / "bad_role.jsonl"), token=tok, check=False)
    assert text.rc == 1 and "line 7: [bad_role]" in text.out, text.out + text.err
    ids = [o["id"] for o in live.cli("files", "list", "--json", token=tok).json()["data"]]
    assert up["id"] in ids
    assert live.cli("files", "show", up["id"], "--json", token=tok).json()["id"] == up["id"]
    assert live.cli("files", "rm", up["id"], "--json", token=tok).json()["deleted"] is True
    missing = live.cli("files", "show", up["id"], token=tok, check=False)
    assert missing.rc == 1 and "404" in missing.err and "Traceback" not in missing.err


def test_cli_login_saves_private_credentials(live: Live) -> None:
    res = live.cli("login", "--url", live.url, "--token", live.tokens[TENANT_B])
    cred = Path(live.env["SFT_CREDENTIALS_FILE"])
    assert cred.stat().st_mode & 0o777 == 0o600 and "saved" in res.out
    env_without = {k: v for k, v in live.env.items() if k not in ("SFT_API_URL", "SFT_API_TOKEN")}
    out = subprocess.run([sys.executable, "-m", "gateway", "files", "list", "--json"], cwd=ROOT,
                         env=env_without, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["data"] == []


def test_300mb_upload_over_256mb_limit_is_cut_off_with_flat_memory(live: Live) -> None:
    block = chat_lines(5000, start=7)
    total = 300 * 1024 * 1024
    boundary = "sftboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode()

    def body() -> Iterator[bytes]:   # no Content-Length: the server must cut it off while streaming
        yield head
        sent = 0
        while sent < total:
            yield block
            sent += len(block)
        yield f"\r\n--{boundary}--\r\n".encode()

    before = live.peak_rss_mb()
    try:
        r = httpx.post(live.url + "/v1/files", content=body(), timeout=300,
                       headers={"Authorization": f"Bearer {live.tokens[TENANT_A]}",
                                "Content-Type": f"multipart/form-data; boundary={boundary}"})
        assert r.status_code == 413, r.text
        assert "limit" in r.json()["error"]["message"]
    except httpx.TransportError:
        pass  # the server may close the connection once it has answered 413
    grew = live.peak_rss_mb() - before
    print(f"\n300 MB upload over a 256 MB limit: server peak RSS grew {grew:.1f} MB")
    assert grew < 64
    datasets = live.storage / "tenants" / TENANT_A / "datasets"
    assert not any(p.name.startswith(".upload-") for p in datasets.iterdir())
    assert not any(p.stat().st_size > 200 * 1024 * 1024 for p in datasets.iterdir())
    assert httpx.get(live.url + "/healthz").status_code == 200
