"""Helpers shared by the trainer tests (spec builder, trainer subprocess runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
CANARY = "CANARY-5f2e9d7c-DO-NOT-LOG"


@dataclass(frozen=True)
class Tiny:
    root: Path
    name: str
    digest: str
    path: Path


@dataclass(frozen=True)
class ToyData:
    train: Path
    train_sha: str
    val: Path
    val_sha: str


def make_spec(tiny: Tiny, toy: ToyData, job_dir: Path, **hyper: Any) -> dict[str, Any]:
    """A small valid spec dict; keyword arguments override hyperparameters."""
    hp = {
        "epochs": 2,
        "learning_rate": 1e-2,
        "batch_size_tokens": 384,
        "max_seq_len": 256,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "warmup_steps": 4,
        "seed": 0,
        "gradient_checkpointing": True,
    }
    hp.update(hyper)
    return {
        "job_id": "job-test",
        "base_model": {"name": tiny.name, "digest": tiny.digest, "catalog_root": str(tiny.root)},
        "train": {"path": str(toy.train), "sha256": toy.train_sha},
        "validation": {"path": str(toy.val), "sha256": toy.val_sha},
        "hyperparameters": hp,
        "job_dir": str(job_dir),
        "checkpoint_every_steps": 4,
        "keep_checkpoints": 2,
    }


def write_spec(spec: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path


def trainer_env(attempt: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    if attempt is not None:
        env["SLURM_RESTART_COUNT"] = str(attempt)
    env.update(extra or {})
    return env


def start_trainer(
    spec_path: Path, log: Path, attempt: int | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``python -m trainer run`` as a real process, output to ``log``; ``env`` adds variables."""
    out = open(log, "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "run", str(spec_path)],
        cwd=REPO,
        env=trainer_env(attempt, env),
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def run_trainer(
    spec_path: Path, log: Path, attempt: int | None = None, timeout: float = 300, env: dict[str, str] | None = None
) -> int:
    """Run the trainer to its end; return its exit code."""
    proc = start_trainer(spec_path, log, attempt, env)
    return proc.wait(timeout=timeout)


def events(job_dir: Path) -> list[dict[str, Any]]:
    from trainer.events import read_events

    path = job_dir / "events.jsonl"
    return read_events(path) if path.exists() else []


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def losses(staging: Path) -> list[tuple[int, float]]:
    lines = (staging / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["loss"]) for m in map(json.loads, lines)]


@dataclass(frozen=True)
class Reference:
    spec: dict[str, Any]
    job_dir: Path
    staging: Path
    log: Path
    rc: int
    seconds: float


def adapter(staging: Path) -> dict[str, Any]:
    """The published LoRA tensors of a staging directory."""
    from safetensors.torch import load_file

    return load_file(staging / "adapter_model.safetensors")


def assert_same_run(staging: Path, reference_staging: Path) -> None:
    """``staging`` is complete and bit-identical to ``reference_staging``: loss curve and adapter."""
    import torch

    assert (staging / "COMPLETE").is_file()
    assert losses(staging) == losses(reference_staging)  # bit-identical loss curve
    mine, theirs = adapter(staging), adapter(reference_staging)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


def lora_with_random_b(path: Path, **hyper: Any) -> Any:
    """The tiny model at ``path`` loaded and LoRA-wrapped as the trainer does (r 8, alpha 16, no
    dropout; ``hyper`` overrides), LoRA B drawn at random (seeded) so gradients reach every LoRA
    weight, in train mode."""
    import torch

    from trainer.contract.spec import Hyperparameters
    from trainer.model import add_lora, load_base_model

    hp = Hyperparameters(**{"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, **hyper})
    model = add_lora(load_base_model(path, "cpu"), hp)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.train()
    return model
