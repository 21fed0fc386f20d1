"""Continued training (``init_adapter``): a child starts from its parent's published adapter."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import Reference, Tiny, ToyData, events, make_spec, run_trainer, write_spec

from trainer.contract import exitcodes

pytestmark = pytest.mark.train


def _tar(staging: Path, out: Path, extra: dict[str, bytes] | None = None) -> dict[str, str]:
    """The parent's adapter tar as the broker builds it (``<job>/<file>`` members); its pin."""
    with tarfile.open(out, "w") as tar:
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            tar.add(staging / name, arcname=f"job-parent/{name}")
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return {"path": str(out), "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}


def _evals(job_dir: Path) -> list[dict[str, Any]]:
    return [e for e in events(job_dir) if e["type"] == "eval"]


def test_a_child_starts_at_its_parents_eval_loss(reference: Reference, tiny: Tiny, toy: ToyData,
                                                 tmp_path: Path) -> None:
    parent_after = json.loads((reference.staging / "eval.json").read_text())["after"]
    spec = make_spec(tiny, toy, tmp_path / "job", epochs=1)
    spec["init_adapter"] = _tar(reference.staging, tmp_path / "parent.tar")
    assert run_trainer(write_spec(spec, tmp_path / "spec.json"), tmp_path / "child.log") == exitcodes.OK
    before = _evals(tmp_path / "job")[0]
    assert before["when"] == "before"
    diff = abs(before["loss"] - parent_after["loss"]) / parent_after["loss"]
    print(f"\nparent's final eval loss {parent_after['loss']:.6f}, the child's before training "
          f"{before['loss']:.6f} (relative difference {diff:.1e}); a fresh LoRA starts at "
          f"{json.loads((reference.staging / 'eval.json').read_text())['before']['loss']:.4f}")
    assert diff < 1e-5 and before["tokens"] == parent_after["tokens"]


@pytest.mark.parametrize("case", ["sha256", "not_a_tar", "two_members", "other_rank"])
def test_a_bad_parent_adapter_is_a_clear_user_error(case: str, reference: Reference, tiny: Tiny, toy: ToyData,
                                                    tmp_path: Path) -> None:
    spec = make_spec(tiny, toy, tmp_path / "job", epochs=1)
    pin = _tar(reference.staging, tmp_path / "parent.tar",
               {"x/adapter_model.safetensors": b"x"} if case == "two_members" else None)
    if case == "sha256":
        pin["sha256"] = "0" * 64
    elif case == "not_a_tar":
        (tmp_path / "parent.tar").write_bytes(b"not a tar at all" * 100)
        pin["sha256"] = hashlib.sha256((tmp_path / "parent.tar").read_bytes()).hexdigest()
    elif case == "other_rank":
        spec["hyperparameters"]["lora_r"] = 4
    spec["init_adapter"] = pin
    rc = run_trainer(write_spec(spec, tmp_path / "spec.json"), tmp_path / "child.log")
    failed = [e for e in events(tmp_path / "job") if e["type"] == "failed"]
    print(f"\n{case}: exit {rc}: {failed[0]['message'] if failed else '-'}")
    assert rc == exitcodes.USER_ERROR and failed and failed[0]["reason"] == "user_error"
    expected = {"sha256": "the published adapter was changed", "not_a_tar": "not a readable tar",
                "two_members": "not one regular adapter_model.safetensors",
                "other_rank": "does not fit this job's LoRA"}[case]
    assert expected in failed[0]["message"]
    assert not [e for e in events(tmp_path / "job") if e["type"] == "metrics"]   # nothing trained
