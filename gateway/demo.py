"""`finetune demo`: the README's main job, end to end through the gateway.

On this host (root) it brings the one-host Slurm cluster up, onboards tenant
``demo`` (unix user, Slurm account + QOS, private storage, DB row, API token),
registers the tiny base model, starts the gateway (SQLite) with its reconciler,
uploads a chat dataset through the HTTP API, creates a fine-tuning job, follows it
live, downloads the adapter, shows eval before/after and a sample generation from
the fine-tuned model, and prints where everything is.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from gateway.config import Settings
from gateway.services.jobs import job_dir

TENANT = "demo"
MODEL = "tiny-chat"
PROMPT = "reverse: alpha mirror pencil"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _register_tiny_model(root: Path, echo: Callable[[str], None]) -> str:
    from trainer import catalog

    for entry in catalog.list_models(root):
        if entry.name == MODEL:
            return entry.digest
    echo(f"      building the tiny base model offline and registering it as {MODEL!r}")
    with tempfile.TemporaryDirectory() as tmp:
        return catalog.add(catalog.make_tiny(Path(tmp) / "tiny"), MODEL, root).digest


class _Gateway:
    """The gateway in a child process that drops to the service user before it serves (the
    control plane never runs as root); the demo itself stays a client."""

    def __init__(self, settings: Settings):
        from gateway.privsep import become_service_user

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pid = os.fork()
        if self.pid != 0:
            import atexit

            atexit.register(self.stop)
        if self.pid == 0:           # the child: drop, then serve until told to stop
            code = 1
            try:
                import uvicorn

                from gateway.api.app import create_app

                become_service_user(settings)
                uvicorn.run(create_app(settings), host="127.0.0.1", port=self.port, log_level="warning")
                code = 0
            finally:
                os._exit(code)
        for _ in range(600):
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("the gateway did not start")

    def stop(self) -> None:
        import signal

        try:
            os.kill(self.pid, signal.SIGTERM)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _sample_generation(model_dir: Path, adapter_dir: Path) -> tuple[str, str]:
    """Greedy replies to PROMPT from the base model and from base + adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    ids: Any = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)

    def reply(model: Any) -> str:
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=12, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        return str(tok.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)).strip()

    before = reply(base)
    tuned = PeftModel.from_pretrained(base, adapter_dir)
    return before, reply(tuned)


def run_demo(settings: Settings, echo: Callable[[str], None] = print) -> int:
    """Run the walk-through; return 0 when the job succeeded and its adapter loads."""
    from gateway.db import make_engine, migrate, session_scope
    from gateway.models import Role
    from gateway.services.tenants import ensure_tenant
    from gateway.services.tokens import create_token
    from gateway.slurm import LocalRunner
    from gateway.slurm.admin import Admin
    from gateway.slurm.devcluster import DevCluster
    from gateway.usercli import extract_adapter, progress_line
    from trainer import catalog
    from trainer.toydata import toy_conversations

    t_start = time.monotonic()
    out = Path(os.getcwd()) / "demo-output"
    settings = settings.model_copy(update={"reconcile_interval_s": 1.0})
    seconds = DevCluster(echo=echo).up()
    echo(f"[1/7] Slurm dev cluster up in {seconds:.1f}s (slurmctld, slurmdbd on MariaDB, 2 x slurmd, 8 fake GPUs)")
    tenant = Admin(LocalRunner(), storage_root=settings.storage_root,
                   parent_account=settings.parent_account).add_tenant(TENANT, shares=10,
                                                                       qos=["ft-small", "ft-standard"])
    engine = make_engine(settings.database_url)
    migrate(engine)
    with session_scope(engine) as s:
        token, _ = create_token(session=s, role=Role.MEMBER, tenant=ensure_tenant(session=s, name=TENANT),
                                name="demo")
    echo(f"[2/7] tenant {TENANT}: unix user {tenant.unix_user}, Slurm account {TENANT} "
         f"(QOS {','.join(tenant.qos)}), storage {tenant.storage} (0700), API token minted")
    digest = _register_tiny_model(settings.models_root, echo)
    server = _Gateway(settings)
    url = server.url
    echo(f"[3/7] gateway on {url} as {settings.service_user} (pid {server.pid}; database "
         f"{settings.database_url}); base model {MODEL} pinned at {digest[:19]}...")
    headers = {"Authorization": f"Bearer {token}"}
    client = httpx.Client(base_url=url, headers=headers, timeout=120)
    out.mkdir(exist_ok=True)
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in toy_conversations(300, seed=1)))
    with open(data, "rb") as f:
        fobj = client.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": (data.name, f)}).json()
    stats = fobj["validation"]["stats"]
    echo(f"[4/7] uploaded {data.name}: {fobj['status']}, {stats['examples']} examples, "
         f"{stats['tokens']['total']} tokens (p95 {stats['tokens']['p95']}) -> {fobj['id']}")
    job = client.post("/v1/fine_tuning/jobs", json={
        "model": MODEL, "training_file": fobj["id"], "suffix": "demo",
        "hyperparameters": {"n_epochs": 4, "learning_rate_multiplier": 25, "batch_size_tokens": 1024,
                            "max_seq_len": 256, "checkpoint_every_steps": 10}}).json()
    if "error" in job and "id" not in job:
        echo(f"job creation failed: {job['error']['message']}")
        return 1
    echo(f"[5/7] job {job['id']} -> Slurm job {job['slurm_job_id']} as {tenant.unix_user} "
         f"(account {TENANT}, QOS {job['qos']}, gres/gpu=1, --time from the estimate)")
    last = ""
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(1)
        job = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
        line = progress_line(job)
        if line != last:
            echo(f"      {line}")
            last = line
    if job["status"] != "succeeded":
        echo(f"[6/7] FAILED: {job['status']}: {(job.get('error') or {}).get('message')}")
        server.stop()
        return 1
    files: dict[str, Path] = {}
    for fid in job["result_files"]:
        meta = client.get(f"/v1/files/{fid}").json()
        name = meta["filename"].removeprefix(f"{job['id']}-")
        files[name] = out / name
        files[name].write_bytes(client.get(f"/v1/files/{fid}/content").content)
    adapter = extract_adapter(files["adapter.tar"], out / "adapter")
    evaluation = json.loads(files["eval.json"].read_text())
    b, a = evaluation["before"], evaluation["after"]
    echo(f"[6/7] {job['fine_tuned_model']} succeeded: {job['trained_tokens']} tokens trained")
    echo(f"      eval loss {b['loss']:.3f} -> {a['loss']:.3f}, perplexity {b['perplexity']:.0f} -> "
         f"{a['perplexity']:.1f}, token accuracy {b['token_accuracy']:.2f} -> {a['token_accuracy']:.2f}")
    entry = next(e for e in catalog.list_models(settings.models_root) if e.name == MODEL)
    before, after = _sample_generation(settings.models_root / entry.path, adapter)
    echo(f"      sample: user {PROMPT!r}\n        base model:       {before!r}\n        fine-tuned model: {after!r}")
    deadline = time.monotonic() + 30
    while job["cleanup"] != "confirmed" and time.monotonic() < deadline:
        time.sleep(1)
        job = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    server.stop()
    echo(f"[7/7] done in {time.monotonic() - t_start:.0f}s; node cleanup: {job['cleanup']}")
    echo(f"      adapter (PEFT):   {adapter}\n      results:          {out}\n"
         f"      job dir (tenant): {job_dir(settings, TENANT, job['id'])}\n"
         f"      gateway DB:       {settings.database_url}\n"
         f"      try:  SFT_API_URL=<url> SFT_API_TOKEN=<token> finetune jobs list")
    return 0
