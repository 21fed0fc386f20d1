"""The simulated trainer (``python -m trainer.simulate``) seen from the outside, as the gateway sees
a real trainer: its events, checkpoints, staging directory, exit codes, signals and resume, and
its memory (320 of them share one 24 GiB host)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import REPO, events, trainer_env, wait_for

from trainer import simulate
from trainer.contract import exitcodes
from trainer.events import EVENT_TYPES

pytestmark = pytest.mark.unit

JOB_ID = "ftjob-0123456789abcdef01234567"
DIGEST = "sha256:" + "ab" * 32
MAX_RSS_KB = 40 * 1024


def _spec(tmp_path: Path, **fields: Any) -> tuple[Path, dict[str, Any]]:
    """A spec of 12 steps (2 epochs of 6) with checkpoints every 4, in a tenant-root layout
    (``<root>/jobs/<job id>``) that ``publish_build`` can read; ``fields`` override the job's."""
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    line = json.dumps({"messages": [{"role": "user", "content": "hi " * 40},
                                    {"role": "assistant", "content": "hello " * 40}]}) + "\n"
    train.write_text(line * (48_000 // len(line)))   # ~12k tokens: 6 steps of 2048 per epoch
    val.write_text(line * 8)
    spec = {"job_id": JOB_ID, "base_model": {"name": "tiny", "digest": DIGEST},
            "train": {"path": str(train), "sha256": "cd" * 32}, "validation": {"path": str(val), "sha256": "ef" * 32},
            "hyperparameters": {"epochs": 2, "batch_size_tokens": 2048, "max_seq_len": 1024, "warmup_steps": 2},
            "job_dir": str(tmp_path / "root" / "jobs" / JOB_ID), "checkpoint_every_steps": 4, "keep_checkpoints": 2,
            **fields}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path, spec


def _start(spec_path: Path, *args: str, attempt: int | None = None,
           env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "trainer.simulate", str(spec_path), *args], cwd=REPO,
                            env=trainer_env(attempt, env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen[bytes], timeout: float = 20) -> int:
    _, err = proc.communicate(timeout=timeout)
    sys.stderr.write(err.decode(errors="replace"))
    return proc.returncode


def _wait_step(job_dir: Path, step: int, attempt: int = 0) -> None:
    assert wait_for(lambda: any(e["type"] == "metrics" and e["attempt"] == attempt and e["step"] >= step
                                for e in events(job_dir)), timeout=10)


def _peak_rss_kb(proc: subprocess.Popen[bytes]) -> int:
    """The child's peak RSS (VmHWM), sampled until it exits."""
    peak = 0
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            break
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peak = max(peak, int(line.split()[1]))
        time.sleep(0.05)
    return peak


def _check_events(job_dir: Path) -> list[dict[str, Any]]:
    evs = events(job_dir)
    assert {e["type"] for e in evs} <= EVENT_TYPES
    for attempt in {e["attempt"] for e in evs}:
        steps = [e["step"] for e in evs if e["type"] == "metrics" and e["attempt"] == attempt]
        assert steps == sorted(set(steps)), "steps increase within an attempt"
    return evs


def _verify(job_dir: Path, attempt: int) -> dict[str, Any]:
    from gateway.storage.verbs import verify_staging

    fd = os.open(job_dir / "attempts" / str(attempt) / "staging", os.O_RDONLY | os.O_DIRECTORY)
    try:
        manifest, opened = verify_staging(fd, attempt=attempt, model_digest=DIGEST)
        for opened_fd in opened.values():
            os.close(opened_fd)
        return manifest
    finally:
        os.close(fd)


def test_a_run_writes_what_the_gateway_publishes(tmp_path: Path) -> None:
    from gateway.storage.verbs import Ctx, peft_header, publish_build

    spec_path, spec = _spec(tmp_path)
    job_dir = Path(spec["job_dir"])
    proc = _start(spec_path, "--seconds", "1")
    peak = _peak_rss_kb(proc)
    assert _finish(proc) == exitcodes.OK
    assert 0 < peak < MAX_RSS_KB, f"peak RSS {peak} kB"
    evs = _check_events(job_dir)
    kinds = [e["type"] for e in evs]
    assert kinds[:3] == ["start", "phase", "phase"] and kinds[-1] == "done"
    assert [e["step"] for e in evs if e["type"] == "metrics"] == list(range(1, 13))
    assert all(e["total_steps"] == 12 and e["tokens"] > 0 and e["lr"] > 0 for e in evs if e["type"] == "metrics")
    losses = [e["loss"] for e in evs if e["type"] == "metrics"]
    assert losses[0] > losses[-1]
    evals = {e["when"]: e["loss"] for e in evs if e["type"] == "eval"}
    assert evals["after"] < evals["before"]
    assert [e["step"] for e in evs if e["type"] == "checkpoint"] == [4, 8, 12]
    kept = sorted(p.name for p in (job_dir / "checkpoints").iterdir())
    assert kept == ["step-12", "step-8"]   # keep_checkpoints 2: step 4 pruned
    for name in kept:
        assert (job_dir / "checkpoints" / name / "COMPLETE").is_file()
        fd = os.open(job_dir / "checkpoints" / name / "adapter.safetensors", os.O_RDONLY)
        try:
            head, _, _ = peft_header(fd)
        finally:
            os.close(fd)
        assert b"q_proj.lora_A.weight" in head and b".default." not in head
    manifest = _verify(job_dir, 0)
    assert manifest["steps"] == 12 and manifest["simulated"] is True and "slurm-finetune" in manifest["versions"]
    root = os.open(tmp_path / "root", os.O_RDONLY | os.O_DIRECTORY)
    try:
        built = publish_build(Ctx("t", root, str(tmp_path / "root"), None),
                              {"job_id": JOB_ID, "attempt": 0, "model_digest": DIGEST, "checkpoint_steps": [4, 8, 12]},
                              []).result
    finally:
        os.close(root)
    assert built["checkpoints"] == [8, 12] and set(built["skipped_checkpoints"]) == {"4"}
    assert {"adapter.tar", "eval.json", "metrics.csv"} <= set(built["results"])


def test_sigusr1_checkpoints_and_requeues_then_the_next_attempt_resumes(tmp_path: Path) -> None:
    spec_path, spec = _spec(tmp_path)
    job_dir = Path(spec["job_dir"])
    proc = _start(spec_path, "--seconds", "2")
    _wait_step(job_dir, 5)
    proc.send_signal(signal.SIGUSR1)
    assert _finish(proc) == exitcodes.REQUEUE
    stopped = events(job_dir)[-1]
    assert stopped["type"] == "stopped" and stopped["signal"] == "SIGUSR1" and stopped["exit_code"] == 75
    saved = stopped["checkpoint_step"]
    assert saved == stopped["step"] >= 5 and (job_dir / "checkpoints" / f"step-{saved}" / "COMPLETE").is_file()
    assert not (job_dir / "attempts" / "0" / "staging" / "COMPLETE").exists()

    assert _finish(_start(spec_path, "--seconds", "2", attempt=1)) == exitcodes.OK
    evs = _check_events(job_dir)
    second = [e for e in evs if e["attempt"] == 1]
    assert {"type": "start", "resumed_from_step": saved}.items() <= next(
        e for e in second if "resumed_from_step" in e).items()
    assert [e["step"] for e in second if e["type"] == "metrics"] == list(range(saved + 1, 13))
    assert _verify(job_dir, 1)["steps"] == 12


def test_sigterm_cancels_within_a_step_and_never_completes(tmp_path: Path) -> None:
    spec_path, spec = _spec(tmp_path)
    job_dir = Path(spec["job_dir"])
    proc = _start(spec_path, "--seconds", "12")     # 1 s steps
    _wait_step(job_dir, 1)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert _finish(proc) == exitcodes.CANCELLED
    assert time.monotonic() - sent < 0.8
    stopped = events(job_dir)[-1]
    assert stopped["type"] == "stopped" and stopped["signal"] == "SIGTERM" and stopped["exit_code"] == 143
    assert not (job_dir / "attempts" / "0" / "staging" / "COMPLETE").exists()


def test_a_gang_writes_from_rank_0_only(tmp_path: Path) -> None:
    spec_path, spec = _spec(tmp_path, world_size=2)
    ranks = [_start(spec_path, "--seconds", "0.5", env={"WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in (1, 0)]
    assert [_finish(p) for p in ranks] == [exitcodes.OK, exitcodes.OK]
    evs = _check_events(Path(spec["job_dir"]))
    assert [e["type"] for e in evs].count("start") == 1 and evs[-1]["type"] == "done"
    assert _verify(Path(spec["job_dir"]), 0)["world_size"] == 2


def test_injected_failure_and_invalid_spec(tmp_path: Path) -> None:
    spec_path, spec = _spec(tmp_path)
    assert _finish(_start(spec_path, "--seconds", "0.3", "--fail-at-step", "2")) == exitcodes.INTERNAL
    failed = events(Path(spec["job_dir"]))[-1]
    assert failed["type"] == "failed" and failed["error"] == "SimulatedFailure"
    spec_path.write_text("{}")
    assert _finish(_start(spec_path)) == exitcodes.USER_ERROR


def test_the_defaults_are_the_contracts() -> None:
    from trainer.contract.spec import HYPERPARAMETER_DEFAULTS, JobSpec

    assert simulate.HYPERPARAMETERS == dict(HYPERPARAMETER_DEFAULTS)
    used = ("validation_split", "checkpoint_every_steps", "keep_checkpoints", "world_size", "fsdp", "method")
    assert {k: simulate.JOB[k] for k in used} == {k: JobSpec.model_fields[k].default for k in used}


def test_the_plan() -> None:
    hp = {**simulate.HYPERPARAMETERS, "epochs": 2, "batch_size_tokens": 1000}
    plan = simulate.make_plan(hp, 40_000, None, 0.1, world_size=2, tokens_per_s=500, speedup=10, seconds=None)
    assert (plan.steps_per_epoch, plan.total_steps, plan.eval_tokens) == (9, 18, 1000)   # 9000 train tokens
    assert sum(plan.step_tokens(s) for s in range(1, 10)) == 9000
    assert plan.step_s * plan.total_steps == pytest.approx(18_000 / (500 * 2) / 10)
    fixed = simulate.make_plan({**hp, "max_steps": 5}, 40_000, 400, 0.1, world_size=1, tokens_per_s=1, speedup=1,
                               seconds=60)
    assert (fixed.total_steps, fixed.step_s, fixed.eval_tokens) == (5, 12, 100)
