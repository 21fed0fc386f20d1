"""A run whose loss becomes NaN or infinite stops at that step as a user error, with the fix named,
instead of burning GPU hours to the end and publishing garbage. The run continues an adapter whose
weights exploded (finite, but ~1e38: the forward pass overflows), as one a diverged run leaves."""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

import pytest
from trainer_testlib import Reference, Tiny, ToyData, events, make_spec, run_trainer, write_spec

from trainer.contract import exitcodes

pytestmark = pytest.mark.train


def _exploded(reference: Reference, tmp: Path) -> dict[str, str]:
    from safetensors.torch import load_file, save_file

    tensors = load_file(reference.staging / "adapter_model.safetensors")
    save_file({k: v * 3e37 if "lora_B" in k else v for k, v in tensors.items()}, tmp / "adapter_model.safetensors")
    out = tmp / "exploded.tar"
    with tarfile.open(out, "w") as tar:
        tar.add(tmp / "adapter_model.safetensors", arcname="job-parent/adapter_model.safetensors")
        tar.add(reference.staging / "adapter_config.json", arcname="job-parent/adapter_config.json")
    return {"path": str(out), "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}


def test_a_non_finite_loss_fails_the_run_at_once_as_a_user_error(reference: Reference, tiny: Tiny, toy: ToyData,
                                                                 tmp_path: Path) -> None:
    spec = make_spec(tiny, toy, tmp_path / "job", epochs=1)
    spec["init_adapter"] = _exploded(reference, tmp_path)
    code = run_trainer(write_spec(spec, tmp_path / "spec.json"), tmp_path / "log")
    evs = events(Path(spec["job_dir"]))
    assert code == exitcodes.USER_ERROR, (tmp_path / "log").read_text()[-2000:]
    failed = [e for e in evs if e["type"] == "failed"]
    assert len(failed) == 1 and failed[0]["reason"] == "user_error" and failed[0]["error"] == "DivergedError"
    print(f"\n{failed[0]['message']}")
    assert "diverged at step 1" in failed[0]["message"] and "lower the learning rate" in failed[0]["message"]
    assert not [e for e in evs if e["type"] == "metrics"]           # it stopped at the first bad step
    assert not (Path(spec["job_dir"]) / "attempts" / "0" / "staging" / "COMPLETE").exists()


def test_every_eval_reports_the_standard_error_of_its_rows(reference: Reference) -> None:
    """What the gateway's eval-spread detector reads: each eval's standard error over its rows."""
    import math

    from trainer.model import eval_metrics

    evals = [e for e in events(reference.job_dir) if e["type"] == "eval"]
    assert evals and all(isinstance(e["loss_stderr"], float) and 0 < e["loss_stderr"] < e["loss"] for e in evals)
    # the formula: rows with mean losses 1, 2, 3 -> sample sd 1, standard error 1/sqrt(3)
    got = eval_metrics(6.0, 3, 0, 3, (6.0, 14.0, 3))["loss_stderr"]
    assert got == pytest.approx(1 / math.sqrt(3)) and eval_metrics(1.0, 1, 0, 1, (1.0, 1.0, 1))["loss_stderr"] is None


def test_the_test_only_learning_rate_blow_up_makes_the_next_step_diverge(tiny: Tiny, toy: ToyData,
                                                                          tmp_path: Path) -> None:
    """The fault the live test injects through the gateway (``SFT_TEST_JOB_ENV``): the test tier's
    ``SFT_TEST_FAULT_LR_BLOWUP_AT_STEP=2`` runs step 2 at learning rate 1e30; steps 1 and 2 report finite
    losses, step 3 fails the run."""
    spec = make_spec(tiny, toy, tmp_path / "job", epochs=1)
    code = run_trainer(write_spec(spec, tmp_path / "spec.json"), tmp_path / "log",
                       env={"SFT_TEST_TIER": "1", "SFT_TEST_FAULT_LR_BLOWUP_AT_STEP": "2"})
    evs = events(Path(spec["job_dir"]))
    assert code == exitcodes.USER_ERROR, (tmp_path / "log").read_text()[-2000:]
    assert [e["step"] for e in evs if e["type"] == "metrics"] == [1, 2]
    (failed,) = [e for e in evs if e["type"] == "failed"]
    assert failed["error"] == "DivergedError" and "diverged at step 3" in failed["message"], failed
