"""`finetune demo`: the end-to-end walk-through on the one-host dev cluster.

Brings the cluster up, onboards a tenant, registers the tiny base model, puts a
chat dataset in the tenant's private storage, submits a QLoRA job through the
Slurm client as the tenant's unix user, follows its progress events, and prints
the evaluation and Slurm's accounting record. Later issues route the same steps
through the HTTP API.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from gateway.config import Settings
from gateway.slurm import JobScript, LocalRunner, SlurmClient
from gateway.slurm.admin import Admin, unix_user_for
from gateway.slurm.devcluster import DevCluster

TENANT = "demo"
MODEL = "tiny-chat"


def _chown_tree(path: Path, user: str) -> None:
    shutil.chown(path, user, user)
    for p in path.rglob("*"):
        shutil.chown(p, user, user)


def _register_tiny_model(root: Path, echo: Callable[[str], None]) -> tuple[str, str]:
    from trainer import catalog

    for entry in catalog.list_models(root):
        if entry.name == MODEL:
            return entry.name, entry.digest
    echo(f"building the tiny base model offline and registering it as {MODEL!r} ...")
    with tempfile.TemporaryDirectory() as tmp:
        entry = catalog.add(catalog.make_tiny(Path(tmp) / "tiny"), MODEL, root)
    return entry.name, entry.digest


def _write_dataset(directory: Path, rows: list[dict], user: str) -> tuple[Path, str]:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    sha = hashlib.sha256(data).hexdigest()
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{sha}.jsonl"
    if not path.exists():
        tmp = directory / f".{sha}.tmp"
        tmp.write_bytes(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    _chown_tree(directory, user)
    return path, sha


def run_demo(settings: Settings, echo: Callable[[str], None] = print) -> int:
    """Run the walk-through; return 0 when the job succeeded with a lower eval loss."""
    from trainer.events import read_events
    from trainer.spec import BaseModelRef, DatasetRef, Hyperparameters, JobSpec
    from trainer.toydata import toy_conversations

    seconds = DevCluster(echo=echo).up()
    echo(f"[1/6] dev cluster up in {seconds:.1f}s")
    runner = LocalRunner()
    admin = Admin(runner, storage_root=settings.storage_root,
                  parent_account=settings.parent_account)
    tenant = admin.add_tenant(TENANT, shares=10, qos=["ft-small", "ft-standard"])
    user = unix_user_for(TENANT)
    echo(f"[2/6] tenant {tenant.name}: unix user {user}, Slurm account {tenant.name}, "
         f"QOS {','.join(tenant.qos)}, storage {tenant.storage} (0700)")

    models_root = settings.storage_root / "models"
    name, digest = _register_tiny_model(models_root, echo)
    echo(f"[3/6] base model {name} pinned at {digest[:19]}...")

    conversations = toy_conversations(400, seed=1)
    train, train_sha = _write_dataset(tenant.storage / "datasets", conversations[:360], user)
    val, val_sha = _write_dataset(tenant.storage / "datasets", conversations[360:], user)
    echo(f"[4/6] datasets in tenant storage: train {train_sha[:12]} (360 chats), "
         f"validation {val_sha[:12]} (40 chats)")

    job_id = "ftjob-demo-" + datetime.now(UTC).strftime("%Y%m%d%H%M%S")
    job_dir = tenant.storage / "jobs" / job_id
    job_dir.mkdir(parents=True, mode=0o700)
    spec = JobSpec(
        job_id=job_id, job_dir=str(job_dir),
        base_model=BaseModelRef(name=name, digest=digest, catalog_root=str(models_root)),
        train=DatasetRef(path=str(train), sha256=train_sha),
        validation=DatasetRef(path=str(val), sha256=val_sha),
        hyperparameters=Hyperparameters(epochs=3, learning_rate=3e-3, batch_size_tokens=1024,
                                        max_seq_len=256, lora_r=8, lora_alpha=16,
                                        warmup_steps=5, seed=0),
        checkpoint_every_steps=20,
    )
    spec_path = job_dir / "spec.json"
    spec_path.write_text(spec.model_dump_json(indent=1))
    _chown_tree(tenant.storage / "jobs", user)

    client = SlurmClient(runner)
    slurm_id = client.submit(JobScript(
        job_name=job_id, account=TENANT, qos="ft-small", job_dir=str(job_dir),
        command=(str(settings.runtime_python), "-m", "trainer", "run", str(spec_path)),
        gpus=1, cpus=2, mem_mb=4096, time_limit_min=30,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}), user=user)
    echo(f"[5/6] submitted {job_id} as Slurm job {slurm_id} (user {user}, account {TENANT}, "
         "QOS ft-small, gres/gpu=1)")

    seen = 0
    state = None
    while True:
        status = client.states([slurm_id])[slurm_id]
        if status.state != state:
            state = status.state
            echo(f"      slurm: {state}" + (f" ({status.reason})" if status.reason else ""))
        events_file = job_dir / "events.jsonl"
        events = read_events(events_file) if events_file.exists() else []
        for ev in events[seen:]:
            if ev.get("type") == "phase":
                echo(f"      phase: {ev.get('phase')}")
            elif ev.get("type") == "metrics" and (ev.get("step", 0) % 10 == 0
                                                  or ev.get("step") == ev.get("total_steps")):
                echo(f"      step {ev.get('step')}/{ev.get('total_steps')} "
                     f"loss {ev.get('loss', float('nan')):.3f}")
            elif ev.get("type") in ("checkpoint", "done", "failed", "stopped"):
                echo(f"      {ev.get('type')}: " + json.dumps(
                    {k: v for k, v in ev.items() if k not in ("type", "ts", "time")}))
        seen = len(events)
        if not status.active:
            break
        time.sleep(1)

    staging = sorted(job_dir.glob("attempts/*/staging"))
    complete = [s for s in staging if (s / "COMPLETE").exists()]
    acct = client.accounting([slurm_id])
    if acct:
        a = acct[0]
        echo(f"      sacct: {a.state} exit {a.exit} account={a.account} qos={a.qos} "
             f"user={a.user} gpus={a.gpus} elapsed={a.elapsed_s}s")
    if state != "COMPLETED" or not complete:
        echo(f"[6/6] FAILED: Slurm says {state}; see {job_dir}/slurm-{slurm_id}.out")
        return 1
    evaluation = json.loads((complete[-1] / "eval.json").read_text())
    echo(f"[6/6] adapter published in {complete[-1]}")
    echo("      eval: " + json.dumps(evaluation))
    return 0
