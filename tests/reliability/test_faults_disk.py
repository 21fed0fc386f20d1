"""Disk full: during an upload (the gateway's storage on a small tmpfs) and during a
checkpoint (the trainer's job dir on a tiny tmpfs); and the trainer SIGKILLed in the middle
of a checkpoint write. Failures are clean and say why, nothing partial is visible, and the
work resumes from the last complete checkpoint once there is room."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings
from tests.service.conftest import TENANT_A, Gateway, chat_lines

ROOT = Path(__file__).resolve().parents[2]
CATALOG = Path("/srv/slurm-finetune/models")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Any]:
    """mount(size) -> a fresh tmpfs of that size; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounts: list[Path] = []
    # under /var/tmp, not pytest's tmp (root's 0700 dir): tenants' uids must traverse to their storage
    base = Path(tempfile.mkdtemp(prefix="sft-tmpfs-", dir="/var/tmp"))
    os.chmod(base, 0o755)

    def mount(name: str, size: str) -> Path:
        where = base / name
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)], check=True)
        mounts.append(where)
        return where

    yield mount
    for m in mounts:
        subprocess.run(["umount", "-l", str(m)], check=False)
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.service
def test_upload_into_full_storage_is_a_clear_507_and_keeps_nothing(tmpfs: Any, tmp_path: Path) -> None:
    storage = tmpfs("storage", "3m")
    os.chmod(tmp_path, 0o755)
    settings = Settings(storage_root=storage, database_url=f"sqlite:///{tmp_path / 'gw.db'}", default_model=None,
                        max_upload_bytes=16 << 20, max_line_bytes=1 << 20)
    gw = Gateway(settings)
    try:
        small = chat_lines(2000)                          # ~250 KB: fits
        first = gw.upload(TENANT_A, small)
        assert first.status_code == 200 and first.json()["status"] == "processed", first.text
        big = chat_lines(40_000, start=10_000)            # ~5 MB: does not
        r = gw.upload(TENANT_A, big)
        assert r.status_code == 507, (r.status_code, r.text)
        assert r.json()["error"]["code"] == "storage_full" and "full" in r.json()["error"]["message"]
        ddir = storage / "tenants" / TENANT_A / "datasets"
        assert [p.name for p in ddir.iterdir() if p.name.startswith(".")] == [], list(ddir.iterdir())
        assert len(list(ddir.iterdir())) == 1
        listed = gw.client.get("/v1/files", headers=gw.auth(TENANT_A)).json()["data"]
        assert [f["id"] for f in listed] == [first.json()["id"]]
        content = gw.client.get(f"/v1/files/{first.json()['id']}/content", headers=gw.auth(TENANT_A))
        assert content.content == small
        again = gw.upload(TENANT_A, chat_lines(500, start=90_000))   # the space the failed upload took is back
        assert again.status_code == 200 and again.json()["status"] == "processed", again.text
    finally:
        gw.app.state.engine.dispose()


# ------------------------------------------------------------------------------ trainer
def _tiny() -> tuple[str, str]:
    from trainer import catalog

    entry = next((e for e in catalog.list_models(CATALOG) if e.name == "tiny-chat"), None)
    if entry is None:
        pytest.skip("tiny-chat is not in the catalog (finetune models make-tiny /tmp/tiny --register tiny-chat)")
    return entry.name, entry.digest


def _spec(base: Path, job_dir: Path, epochs: int = 2, max_steps: int = 12) -> Path:
    from trainer.data import sha256_file
    from trainer.toydata import toy_conversations, write_jsonl

    name, digest = _tiny()
    train = write_jsonl(base / "train.jsonl", toy_conversations(80, seed=1))
    spec = {"job_id": "job-disk", "base_model": {"name": name, "digest": digest, "catalog_root": str(CATALOG)},
            "train": {"path": str(train), "sha256": sha256_file(train)}, "validation": None,
            "hyperparameters": {"epochs": epochs, "batch_size_tokens": 256, "max_seq_len": 256,
                                "learning_rate": 1e-3, "max_steps": max_steps},
            "job_dir": str(job_dir), "checkpoint_every_steps": 2, "keep_checkpoints": 2}
    path = base / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _trainer(spec: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "trainer", "run", str(spec)], cwd=ROOT, env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115


def _events(job_dir: Path) -> list[dict[str, Any]]:
    path = job_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _visible(job_dir: Path) -> tuple[list[int], list[str]]:
    """(complete checkpoint steps, names that are anything else)."""
    from trainer.checkpoint import complete_steps

    d = job_dir / "checkpoints"
    others = [p.name for p in d.iterdir() if not (p.name.startswith("step-") and (p / "COMPLETE").is_file())]
    return complete_steps(d), others


@pytest.mark.train
@pytest.mark.heavy
def test_disk_full_during_a_checkpoint_fails_cleanly_and_resumes(tmpfs: Any, tmp_path: Path) -> None:
    disk = tmpfs("job", "2500k")        # two ~0.9 MB checkpoints fit; the third (written before pruning) does not
    job_dir = disk / "job"
    spec = _spec(tmp_path, job_dir)
    rc = _trainer(spec, tmp_path / "t1.log").wait(300)
    steps, others = _visible(job_dir)
    failed = [e for e in _events(job_dir) if e["type"] == "failed"]
    print(f"\ndisk full: exit {rc}, complete checkpoints {steps}, other entries {others}, failure {failed}")
    assert rc == 1, (tmp_path / "t1.log").read_text()[-2000:]
    assert others == [] and steps, (steps, others)       # no half-written checkpoint left or visible
    assert failed and failed[-1]["error"] == "StorageFull" and "storage is full" in failed[-1]["message"]
    assert not (job_dir / "attempts" / "0" / "staging" / "COMPLETE").exists()
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)   # the admin frees space
    rc2 = _trainer(spec, tmp_path / "t2.log").wait(300)
    assert rc2 == 0, (tmp_path / "t2.log").read_text()[-2000:]
    starts = [e for e in _events(job_dir) if e["type"] == "start"]
    resumed = [e.get("resumed_from_step") for e in starts]
    print(f"rerun resumed from {resumed[-1]}")
    assert (resumed[-1] or 0) == max(steps), resumed
    assert (job_dir / "attempts" / "0" / "staging" / "COMPLETE").is_file()


@pytest.mark.train
@pytest.mark.heavy
def test_trainer_killed_in_the_middle_of_a_checkpoint_write(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    spec = _spec(tmp_path, job_dir, epochs=3, max_steps=16)
    hits = 0
    for round_ in range(3):
        ck = job_dir / "checkpoints"
        stale = set(os.listdir(ck)) if ck.exists() else set()   # a killed writer's leftovers: not this round's
        proc = _trainer(spec, tmp_path / f"k{round_}.log")
        deadline = time.monotonic() + 240
        caught = False
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                names = os.listdir(ck)
            except FileNotFoundError:
                names = []
            if any(n.startswith(".tmp-step-") and n not in stale for n in names) and \
                    any(n.startswith("step-") for n in names):    # a complete one exists to resume from
                proc.send_signal(signal.SIGKILL)
                caught = True
                break
            time.sleep(0.0005)
        proc.wait(60)
        if caught:
            hits += 1
            steps, others = _visible(job_dir)
            assert all(n.startswith(".tmp-") for n in others), others      # readers never trust these
            print(f"\nkill {round_}: SIGKILL during a checkpoint write; complete {steps}, hidden leftovers {others}")
        elif proc.returncode == 0:
            break
    assert hits >= 1, "never caught a checkpoint write in progress"
    rc = _trainer(spec, tmp_path / "final.log").wait(300)
    assert rc == 0, (tmp_path / "final.log").read_text()[-2000:]
    steps, others = _visible(job_dir)
    assert others == []                                  # the resumed run removed the half-written dirs
    starts = [e for e in _events(job_dir) if e["type"] == "start"]
    assert any((e.get("resumed_from_step") or 0) > 0 for e in starts[1:]), starts
    assert (job_dir / "attempts" / "0" / "staging" / "COMPLETE").is_file()
