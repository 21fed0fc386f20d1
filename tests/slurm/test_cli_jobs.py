"""The tenant CLI end to end, against a real `gateway serve` on the real cluster, with the
gateway's database on SQLite and on PostgreSQL: upload -> jobs create -> follow until
succeeded -> artifacts download --extract -> the adapter loads with PEFT; list, show;
cancel of a finished job is a clear error; cancel of a running one ends `cancelled`."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gateway.db import make_engine
from tests.service.conftest import pg_url  # noqa: F401  (the throwaway PostgreSQL server fixture)
from tests.slurm.livegateway import MODEL, STORAGE, LiveGateway, chat_file

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]
A, B = "t-cli-a", "t-cli-b"
FAST = ["--epochs", "1", "--batch-size-tokens", "512", "--max-seq-len", "256",
        "--learning-rate-multiplier", "10", "--hp", "checkpoint_every_steps=3"]


@dataclass
class Run:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.splitlines() if line.strip()]


def fresh_pg_database(server_url: str) -> str:
    """A new empty database on the throwaway server, so no other test's rows are seen."""
    name = f"sft_cli_{uuid.uuid4().hex[:10]}"
    engine = make_engine(server_url)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return server_url.rsplit("/", 1)[0] + f"/{name}"


class Cli:
    """`python -m gateway ...` as tenant ``who``: a fresh process each time, like a user's shell."""

    def __init__(self, gw: LiveGateway):
        self.gw = gw

    def __call__(self, *args: str, who: str = A, check: bool = True, timeout: float = 180) -> Run:
        env = {**self.gw.env, "SFT_API_URL": self.gw.url, "SFT_API_TOKEN": self.gw.tokens[who]}
        res = subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=timeout)
        run = Run(res.returncode, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr, res.stderr
        if check and res.returncode != 0:
            raise AssertionError(f"finetune {' '.join(args)} exited {res.returncode}: {res.stderr}")
        return run


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def cli(request: pytest.FixtureRequest, cluster: None,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    db_url = None
    if request.param == "postgresql":
        db_url = fresh_pg_database(request.getfixturevalue("pg_url"))
    gw = LiveGateway(tmp_path_factory.mktemp(f"cli-{request.param}"), (A, B), db_url=db_url)
    try:
        yield Cli(gw)
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def train_file(cli: Cli, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = chat_file(tmp_path_factory.mktemp("data") / "train.jsonl", 80)
    up = cli("files", "upload", str(path), "--json").json()
    assert up["status"] == "processed"
    return str(up["id"])


def base_model_dir() -> Path:
    from trainer import catalog

    entry = next(e for e in catalog.list_models(STORAGE / "models") if e.name == MODEL)
    return catalog.resolve(STORAGE / "models", MODEL, entry.digest)


def test_create_follow_download_and_load_adapter(cli: Cli, train_file: str, tmp_path: Path) -> None:
    job = cli("jobs", "create", "--training-file", train_file, "--model", MODEL, "--suffix", "cli",
              "--seed", "7", *FAST, "--json").json()
    assert job["status"] == "queued" and job["slurm_job_id"], job
    assert job["method"]["supervised"]["hyperparameters"]["batch_size_tokens"] == 512

    follow = cli("jobs", "follow", job["id"], "--json", "--interval", "0.5")
    lines = follow.lines()
    events, final = lines[:-1], lines[-1]
    assert final["status"] == "succeeded" and final["fine_tuned_model"].endswith(f":cli:{job['id']}")
    messages = [e["message"] for e in events]
    assert messages[0] == f"Created fine-tuning job: {job['id']}", messages
    assert any(m.startswith("Step ") for m in messages) and "The job has successfully completed" in messages
    ids = [int(e["id"].removeprefix("ftevent-")) for e in events]
    assert ids == sorted(set(ids)), "every event once, oldest first"

    again = cli("jobs", "follow", job["id"])   # a finished job: whole history, progress, exit 0
    assert "Step 1/" in again.out and "succeeded: ft:" in again.out

    out = tmp_path / "results"
    dl = cli("artifacts", "download", job["id"], "-o", str(out), "--extract", "--json").json()
    assert sorted(f["name"] for f in dl["files"]) == ["adapter.tar", "eval.json", "metrics.csv"]
    assert all(Path(f["path"]).stat().st_size == f["bytes"] > 0 for f in dl["files"])
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no temp files left"
    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation, "eval.json holds the before/after evaluation"

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model_dir())
    model = PeftModel.from_pretrained(base, dl["adapter_dir"])
    assert any("lora_" in n for n, _ in model.named_parameters())


def test_list_show_and_cancel_of_a_finished_job(cli: Cli, train_file: str) -> None:
    page = cli("jobs", "list", "--limit", "1", "--json").json()
    assert len(page["data"]) == 1
    done = page["data"][0]
    assert done["status"] == "succeeded"
    assert cli("jobs", "show", done["id"], "--json").json()["id"] == done["id"]
    text = cli("jobs", "show", done["id"])
    assert "succeeded" in text.out and f"slurm job:        {done['slurm_job_id']}" in text.out
    assert done["id"] in cli("jobs", "list").out

    refused = cli("jobs", "cancel", done["id"], check=False)
    assert refused.rc == 1 and "409" in refused.err and "already succeeded" in refused.err, refused.err
    foreign = cli("jobs", "show", done["id"], who=B, check=False)
    assert foreign.rc == 1 and "404" in foreign.err
    none = cli("artifacts", "download", done["id"], who=B, check=False)
    assert none.rc == 1 and "404" in none.err


def test_cancel_running_job_then_follow_exits_1(cli: Cli, train_file: str) -> None:
    job = cli("jobs", "create", "--training-file", train_file, "--model", MODEL, "--epochs", "20",
              "--batch-size-tokens", "512", "--max-seq-len", "256", "--idempotency-key", uuid.uuid4().hex,
              "--json").json()
    gw = cli.gw
    gw.wait(A, job["id"], lambda j: j["status"] == "running" and j["phase"] == "training", timeout=120)
    res = cli("jobs", "cancel", job["id"], "--wait", "--json").json()
    assert res["status"] == "cancelled" and not res["result_files"]
    follow = cli("jobs", "follow", job["id"], check=False)
    assert follow.rc == 1 and "cancelled" in follow.err
    assert "Cancellation requested" in follow.out
