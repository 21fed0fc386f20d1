"""Early stopping on a run that really overfits: the stop, the published best step, exact resume."""

from __future__ import annotations

import copy
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import (
    Reference,
    Tiny,
    ToyData,
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

PATIENCE = 3


@pytest.fixture(scope="module")
def overfit(tmp_path_factory: pytest.TempPathFactory) -> ToyData:
    """16 "repeat" examples to memorize; validation asks the same prompts with the words reversed.

    Learning the chat format and the words helps both at first; memorizing the
    train answers then only hurts the validation answers, so its loss turns up.
    """
    from trainer.data import sha256_file
    from trainer.toydata import toy_conversations, write_jsonl

    base = tmp_path_factory.mktemp("overfit")
    rows = [r for r in toy_conversations(200, seed=1) if r["messages"][-2]["content"].startswith("repeat:")][:16]
    val = copy.deepcopy(rows)
    for row in val:
        row["messages"][-1]["content"] = " ".join(row["messages"][-1]["content"].split()[::-1])
    train, held = write_jsonl(base / "train.jsonl", rows), write_jsonl(base / "val.jsonl", val)
    return ToyData(train, sha256_file(train), held, sha256_file(held))


def _spec(tiny: Tiny, data: ToyData, job_dir: Path) -> dict[str, Any]:
    spec = make_spec(
        tiny,
        data,
        job_dir,
        epochs=20,
        learning_rate=2e-2,
        batch_size_tokens=256,
        max_seq_len=128,
        lora_dropout=0.0,
        warmup_steps=0,
        gradient_checkpointing=False,
        eval_every_steps=2,
        early_stopping_patience=PATIENCE,
    )
    spec["checkpoint_every_steps"] = 5  # the stop step is no multiple: finalize checkpoints it
    return spec


@dataclass(frozen=True)
class Run:
    spec: dict[str, Any]
    job_dir: Path
    staging: Path
    evals: dict[str, Any]
    seconds: float


@pytest.fixture(scope="module")
def stopped(tiny: Tiny, overfit: ToyData, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One uninterrupted early-stopped run."""
    base = tmp_path_factory.mktemp("early-stop")
    spec = _spec(tiny, overfit, base / "job")
    log = base / "trainer.log"
    t0 = time.monotonic()
    rc = run_trainer(write_spec(spec, base / "spec.json"), log)
    seconds = time.monotonic() - t0
    assert rc == 0, log.read_text()[-3000:]
    staging = base / "job" / "attempts" / "0" / "staging"
    return Run(spec, base / "job", staging, json.loads((staging / "eval.json").read_text()), seconds)


def _published(staging: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(staging / "adapter_model.safetensors")


def test_overfitting_run_stops_early_and_publishes_the_best_step(stopped: Run, tiny: Tiny, overfit: ToyData) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from trainer.data import read_conversations, tokenize_all
    from trainer.model import disable_cpu_repack, evaluate, load_base_model

    evals, job_events = stopped.evals, events(stopped.job_dir)
    total = next(e["total_steps"] for e in job_events if e["type"] == "metrics")
    steps = json.loads((stopped.staging / "manifest.json").read_text())["steps"]
    during = {e["step"]: e["loss"] for e in evals["during"]}
    print(f"\nearly-stopped run: {stopped.seconds:.1f} s, {steps} of {total} steps, best step {evals['best_step']}")
    print("validation loss by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in during.items()))
    assert evals["stopped_early"] is True and steps < total
    assert [s for s, _ in losses(stopped.staging)] == list(range(1, steps + 1))
    assert evals["best_step"] < steps and evals["best_loss"] == min(during.values()) == during[evals["best_step"]]
    worse = [s for s in during if s > evals["best_step"]]
    assert len(worse) == PATIENCE and max(worse) == steps
    (stop,) = [e for e in job_events if e["type"] == "early_stop"]
    assert (stop["step"], stop["best_step"], stop["best_loss"]) == (steps, evals["best_step"], evals["best_loss"])
    manifest = json.loads((stopped.staging / "manifest.json").read_text())
    assert manifest["best_step"] == evals["best_step"]
    assert evals["after"]["step"] == evals["best_step"]
    assert evals["after"]["loss"] == pytest.approx(evals["best_loss"], rel=1e-6)
    # the best state lives inside the newest checkpoint; pruning keeps the best step's own dir too (when
    # that step was checkpointed: every 5th), besides the keep_checkpoints newest
    checkpoints = stopped.job_dir / "checkpoints"
    assert (checkpoints / f"step-{evals['best_step']}").exists() == (evals["best_step"] % 5 == 0)
    newest = checkpoints / f"step-{steps}"
    assert json.loads((newest / "progress.json").read_text())["best_step"] == evals["best_step"]
    best = {k.replace(".default.", "."): v for k, v in load_file(newest / "best.safetensors").items()}
    published = _published(stopped.staging)
    assert best.keys() == published.keys()
    assert all(torch.equal(best[k], published[k]) for k in best)
    # and an independent reload of the published adapter scores the best eval's loss
    tokenizer = AutoTokenizer.from_pretrained(stopped.staging)
    val = tokenize_all(tokenizer, read_conversations(overfit.val, "validation"), 128, "validation")
    model = PeftModel.from_pretrained(load_base_model(tiny.path), stopped.staging)
    disable_cpu_repack(model)
    assert evaluate(model, val, 256)["loss"] == pytest.approx(evals["best_loss"], rel=1e-5)


def _steps(job_dir: Path) -> int:
    return max((e["step"] for e in events(job_dir) if e["type"] == "metrics"), default=0)


def _evaluating_after(job_dir: Path, step: int) -> bool:
    """True once an eval started after the metrics of ``step`` or later."""
    seen = False
    for e in events(job_dir):
        seen = seen or (e["type"] == "metrics" and e["step"] >= step)
        if seen and e.get("phase") == "evaluating":
            return True
    return False


def test_requeue_between_best_and_stop_resumes_to_the_same_decision(
    stopped: Run, tiny: Tiny, overfit: ToyData, tmp_path: Path
) -> None:
    import torch

    best, stop = stopped.evals["best_step"], stopped.evals["during"][-1]["step"]
    target = best + 4  # after one worse eval, during the next (which the signal interrupts)
    assert target < stop - 1
    job_dir = tmp_path / "job"
    spec_path = write_spec(_spec(tiny, overfit, job_dir), tmp_path / "spec.json")
    log = tmp_path / "trainer.log"
    proc = start_trainer(spec_path, log)
    assert wait_for(lambda: _evaluating_after(job_dir, target), 120)
    proc.send_signal(signal.SIGSTOP)  # freeze, then make sure the stop has not happened yet
    seen = _steps(job_dir)
    proc.send_signal(signal.SIGUSR1)
    proc.send_signal(signal.SIGCONT)
    assert proc.wait(timeout=60) == exitcodes.REQUEUE, log.read_text()[-3000:]
    assert seen < stop - 1, f"the run reached step {seen} before the signal; the stop is at {stop}"
    kept = max(job_dir.glob("checkpoints/step-*"), key=lambda p: int(p.name.split("-")[1]))
    saved = json.loads((kept / "progress.json").read_text())
    interrupted = saved["evals"][-1]["step"] != saved["step"]
    print(f"\nSIGUSR1 at step {seen}: checkpoint {kept.name}, best step {saved['best_step']}, "
          f"{saved['bad_evals']} eval(s) without improvement, its own eval interrupted: {interrupted}")
    assert saved["best_step"] == best and saved["bad_evals"] >= 1 and not saved["stopped_early"]
    assert (kept / "best.safetensors").is_file()
    assert run_trainer(spec_path, log, attempt=1) == 0, log.read_text()[-3000:]
    staging = job_dir / "attempts" / "1" / "staging"
    evals = json.loads((staging / "eval.json").read_text())
    for key in ("best_step", "best_loss", "stopped_early", "during", "after"):
        assert evals[key] == stopped.evals[key], key  # an interrupted eval is redone, not lost
    assert losses(staging) == losses(stopped.staging)
    mine, theirs = _published(staging), _published(stopped.staging)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_without_early_stopping_the_last_step_is_published(reference: Reference) -> None:
    evals = json.loads((reference.staging / "eval.json").read_text())
    manifest = json.loads((reference.staging / "manifest.json").read_text())
    assert (evals["best_step"], evals["best_loss"], evals["stopped_early"]) == (None, None, False)
    assert manifest["best_step"] is None and evals["after"]["step"] == manifest["steps"]
    assert not list((reference.job_dir / "checkpoints").glob("*/best.safetensors"))
    assert "early_stop" not in {e["type"] for e in events(reference.job_dir)}
