"""The trainer as a real process: SIGKILL + exact resume, SIGUSR1/SIGTERM, fail-fast errors."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import (
    Reference,
    Tiny,
    ToyData,
    assert_same_run,
    events,
    losses,
    make_spec,
    run_trainer,
    start_trainer,
    wait_for,
    write_spec,
)

from trainer.contract import exitcodes

pytestmark = pytest.mark.train




def _steps_since(job_dir: Path, offset: int) -> int:
    metrics = [e["step"] for e in events(job_dir)[offset:] if e["type"] == "metrics"]
    return max(metrics, default=0)


def _reached(job_dir: Path, offset: int, target: int) -> bool:
    return _steps_since(job_dir, offset) >= target


def _catches(pid: int, signum: int) -> bool:
    """True when /proc says the process has a handler for ``signum``."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask >> (signum - 1) & 1)


def _tmp_checkpoints(checkpoints: Path) -> list[str]:
    try:
        return [n for n in os.listdir(checkpoints) if n.startswith(".tmp-step-")]
    except FileNotFoundError:
        return []


def _kill_during_checkpoint_write(proc: subprocess.Popen[bytes], checkpoints: Path) -> str:
    """Freeze the trainer while a checkpoint temp dir exists, then SIGKILL it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if _tmp_checkpoints(checkpoints):
            proc.send_signal(signal.SIGSTOP)
            caught = _tmp_checkpoints(checkpoints)
            if caught:
                proc.kill()
                return caught[0]
            proc.send_signal(signal.SIGCONT)
    pytest.fail("never caught the trainer writing a checkpoint")


def test_sigkill_at_random_points_then_resume_is_exact(
    reference: Reference, tiny: Tiny, toy: ToyData, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    spec_path = write_spec(make_spec(tiny, toy, job_dir), tmp_path / "spec.json")
    log, checkpoints = tmp_path / "trainer.log", job_dir / "checkpoints"
    total = len(losses(reference.staging))
    rng = random.Random(20261130)
    done = 0
    for mode, upper in (("step", total // 3), ("checkpoint", 0), ("step", total - 4)):
        offset = len(events(job_dir))
        proc = start_trainer(spec_path, log)
        if mode == "checkpoint":
            caught = _kill_during_checkpoint_write(proc, checkpoints)
            proc.wait()
            assert (checkpoints / caught).is_dir()  # torn write left behind...
            print(f"\nSIGKILL while writing {caught}")
        else:
            target = rng.randint(done + 2, max(done + 2, upper))
            assert wait_for(partial(_reached, job_dir, offset, target), 120)
            proc.kill()
            proc.wait()
            print(f"\nSIGKILL at step >= {target}")
        assert proc.returncode == -signal.SIGKILL
        done = max(done, _steps_since(job_dir, offset))
    assert run_trainer(spec_path, log) == 0, log.read_text()[-3000:]
    assert not _tmp_checkpoints(checkpoints)  # ...and ignored, then cleaned on resume
    resumed = [e["resumed_from_step"] for e in events(job_dir) if "resumed_from_step" in e]
    print(f"resumed from steps {resumed}")
    assert len(resumed) >= 2
    assert_same_run(job_dir / "attempts" / "0" / "staging", reference.staging)


def _signal_run(
    tiny: Tiny, toy: ToyData, tmp_path: Path, signum: int
) -> tuple[Path, Path, Path, int, float, dict[str, Any]]:
    job_dir = tmp_path / "job"
    spec = make_spec(tiny, toy, job_dir)
    spec["checkpoint_every_steps"] = 1000  # the checkpoint must come from the signal
    if signum == signal.SIGTERM:  # also cover the held-out split and periodic evals
        spec["validation"] = None
        spec["hyperparameters"]["eval_every_steps"] = 2
    spec_path = write_spec(spec, tmp_path / "spec.json")
    log = tmp_path / "trainer.log"
    proc = start_trainer(spec_path, log)
    assert wait_for(lambda: _steps_since(job_dir, 0) >= 5, 120)
    seen = _steps_since(job_dir, 0)
    t0 = time.monotonic()
    proc.send_signal(signum)
    sent = _steps_since(job_dir, 0)  # the bound: this process may lose the CPU between `seen` and the kill
    rc = proc.wait(timeout=60)
    seconds = time.monotonic() - t0
    stopped = next(e for e in events(job_dir) if e["type"] == "stopped")
    name = signal.Signals(signum).name
    print(
        f"\n{name}: exit {rc} {seconds:.3f} s after the signal (in-process "
        f"{stopped['signal_to_exit_s']} s), signal at step {seen}, stopped at {stopped['step']}"
    )
    assert seen <= stopped["step"] <= sent + 1  # at the first stop check after the signal, at the latest
    assert seconds < 3.0
    assert stopped["checkpoint_step"] == stopped["step"]
    assert (job_dir / "checkpoints" / f"step-{stopped['step']}" / "COMPLETE").is_file()
    return job_dir, spec_path, log, rc, seconds, stopped


def test_sigusr1_checkpoints_exits_75_and_requeue_resumes_exactly(
    reference: Reference, tiny: Tiny, toy: ToyData, tmp_path: Path
) -> None:
    job_dir, spec_path, log, rc, _, _ = _signal_run(tiny, toy, tmp_path, signal.SIGUSR1)
    assert rc == exitcodes.REQUEUE == 75
    assert not list(job_dir.glob("attempts/*/staging/COMPLETE"))
    assert run_trainer(spec_path, log, attempt=1) == 0  # Slurm's requeue: SLURM_RESTART_COUNT=1
    assert_same_run(job_dir / "attempts" / "1" / "staging", reference.staging)


def test_sigterm_stops_within_a_step_exits_143_never_complete(tiny: Tiny, toy: ToyData, tmp_path: Path) -> None:
    job_dir, _, _, rc, _, stopped = _signal_run(tiny, toy, tmp_path, signal.SIGTERM)
    assert rc == exitcodes.CANCELLED == 143
    assert stopped["exit_code"] == 143
    evals = [e for e in events(job_dir) if e["type"] == "eval"]
    assert evals[0]["when"] == "before" and evals[1]["when"] == "step" and evals[1]["step"] == 2
    assert evals[0]["examples"] == 24  # 10 % of 240 held out
    assert not list(job_dir.rglob("COMPLETE")) or all("checkpoints" in p.parts for p in job_dir.rglob("COMPLETE"))
    assert not (job_dir / "attempts").exists() or not list((job_dir / "attempts").rglob("COMPLETE"))


def test_sigterm_during_setup_exits_at_once(tiny: Tiny, toy: ToyData, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    proc = start_trainer(write_spec(make_spec(tiny, toy, job_dir), tmp_path / "spec.json"), tmp_path / "trainer.log")
    assert wait_for(lambda: bool(events(job_dir)), 60)  # handlers are installed
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    print(f"\nSIGTERM during setup: exit {rc} after {time.monotonic() - t0:.3f} s")
    assert rc == exitcodes.CANCELLED
    assert not list(job_dir.rglob("COMPLETE"))
    assert [e for e in events(job_dir) if e["type"] == "stopped"]


def test_sigusr1_while_python_is_still_importing_is_not_lost(tiny: Tiny, toy: ToyData, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    proc = start_trainer(write_spec(make_spec(tiny, toy, job_dir), tmp_path / "spec.json"), tmp_path / "trainer.log")
    # the first instant the process catches SIGUSR1 (the kernel's view), imports still running
    assert wait_for(partial(_catches, proc.pid, signal.SIGUSR1), 30, interval=0.001)
    early = not events(job_dir)
    proc.send_signal(signal.SIGUSR1)
    rc = proc.wait(timeout=60)
    print(f"\nSIGUSR1 as soon as it is caught (before any event: {early}): exit {rc}")
    assert rc == exitcodes.REQUEUE  # not 138 (killed by the default action)
    assert not list(job_dir.glob("checkpoints/step-*"))


# ------------------------------------------------------------------ fail fast


def _tampered_catalog(tiny: Tiny, tmp_path: Path) -> Path:
    root = tmp_path / "models"
    shutil.copytree(tiny.root, root)
    config = root / tiny.path.relative_to(tiny.root) / "config.json"
    config.write_text(config.read_text().replace('"hidden_act"', '"hidden_act" ', 1))
    return root


@pytest.mark.parametrize(
    ("case", "expected_rc", "message"),
    [
        ("digest", exitcodes.MODEL_ERROR, "files on disk hash to"),
        ("dataset_sha", exitcodes.USER_ERROR, "the file changed after upload"),
        ("unknown_key", exitcodes.USER_ERROR, "hyperparameters.lr: unknown key; valid keys"),
        ("out_of_range", exitcodes.USER_ERROR, "allowed range: 1 <= epochs <= 100"),
        ("too_long", exitcodes.USER_ERROR, "tokens > max_seq_len 24"),
    ],
)
def test_bad_inputs_fail_fast_before_training(
    case: str, expected_rc: int, message: str, tiny: Tiny, toy: ToyData, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    spec = make_spec(tiny, toy, job_dir)
    if case == "digest":
        spec["base_model"]["catalog_root"] = str(_tampered_catalog(tiny, tmp_path))
    elif case == "dataset_sha":
        spec["train"]["sha256"] = "0" * 64
    elif case == "unknown_key":
        spec["hyperparameters"]["lr"] = 0.1
    elif case == "out_of_range":
        spec["hyperparameters"]["epochs"] = 0
    elif case == "too_long":
        spec["hyperparameters"]["max_seq_len"] = 24
    log = tmp_path / "trainer.log"
    t0 = time.monotonic()
    rc = run_trainer(write_spec(spec, tmp_path / "spec.json"), log)
    seconds = time.monotonic() - t0
    output = log.read_text()
    print(f"\n{case}: exit {rc} in {seconds:.1f} s: {output.strip().splitlines()[-1][:160]}")
    assert rc == expected_rc
    assert message in output
    phases = [e.get("phase") for e in events(job_dir)]
    assert "training" not in phases
    assert not list(job_dir.glob("checkpoints/step-*"))
    if case != "too_long":
        assert seconds < 15  # refused before loading torch or the model


def test_cuda_promised_but_unusable_fails_fast_before_loading(tiny: Tiny, toy: ToyData, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is usable here: nothing to refuse")
    job_dir = tmp_path / "job"
    spec = make_spec(tiny, toy, job_dir)
    spec["device"] = "cuda"
    log = tmp_path / "trainer.log"
    t0 = time.monotonic()
    rc = run_trainer(write_spec(spec, tmp_path / "spec.json"), log, env={"CUDA_VISIBLE_DEVICES": "0"})
    seconds = time.monotonic() - t0
    print(f"\ndevice=cuda without CUDA: exit {rc} in {seconds:.1f} s: {log.read_text().strip().splitlines()[-1]}")
    assert rc == exitcodes.GPU_UNAVAILABLE == 69
    assert "this job was given a GPU but CUDA is not usable here (torch.cuda.is_available() is False; " \
           "CUDA_VISIBLE_DEVICES='0'): refusing to train on the CPU" in log.read_text()
    failed = [e for e in events(job_dir) if e["type"] == "failed"]
    assert [(e["reason"], e["error"]) for e in failed] == [("gpu_unavailable", "GpuUnavailableError")]
    assert "refusing to train on the CPU" in failed[0]["message"]
    assert not [e for e in events(job_dir) if e["type"] == "phase"]  # not even tokenizing
    assert seconds < 30


def test_rerunning_a_complete_attempt_changes_nothing(reference: Reference, tmp_path: Path) -> None:
    staging = reference.staging
    before = {p.name: p.stat().st_mtime_ns for p in staging.iterdir()}
    spec_path = write_spec(reference.spec, tmp_path / "spec.json")
    t0 = time.monotonic()
    assert run_trainer(spec_path, tmp_path / "log") == exitcodes.OK
    assert time.monotonic() - t0 < 15  # no model load, no training
    assert {p.name: p.stat().st_mtime_ns for p in staging.iterdir()} == before
    assert events(reference.job_dir)[-1].get("already_complete") is True
