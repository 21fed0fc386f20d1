"""Spec rules and pure pieces of the warm-up (no training)."""

from __future__ import annotations

import pytest

from trainer.errors import SpecError
from trainer.model import lr_lambda
from trainer.spec import Hyperparameters, parse_spec, spec_hash

pytestmark = pytest.mark.unit


def _spec(**hyper: object) -> dict[str, object]:
    return {
        "base_model": {"name": "tiny", "digest": "sha256:" + "a" * 64, "catalog_root": "/models"},
        "train": {"path": "/d/train.jsonl", "sha256": "b" * 64},
        "job_dir": "/jobs/1",
        "hyperparameters": hyper,
    }


def test_warmup_ratio_names_its_range() -> None:
    with pytest.raises(SpecError, match="hyperparameters.warmup_ratio.*allowed range"):
        parse_spec(_spec(warmup_ratio=0.6))


def test_warmup_steps_and_ratio_together_are_refused() -> None:
    with pytest.raises(SpecError, match=r"set warmup_steps \(10\) or warmup_ratio \(0.1\), not both"):
        parse_spec(_spec(warmup_steps=10, warmup_ratio=0.1))  # even when equal to the default
    assert parse_spec(_spec(warmup_steps=4, warmup_ratio=None)).hyperparameters.warmup_for(100) == 4


@pytest.mark.parametrize(
    ("ratio", "total", "warmup"),
    [(None, 1000, 10), (0.1, 30, 3), (0.1, 31, 4), (0.05, 7, 1), (0.0, 50, 0), (0.5, 9, 5)],
)
def test_warmup_ratio_gives_ceil_of_ratio_times_total(ratio: float | None, total: int, warmup: int) -> None:
    hp = Hyperparameters(warmup_ratio=ratio) if ratio is not None else Hyperparameters()
    assert hp.warmup_for(total) == warmup
    factor = lr_lambda(hp.warmup_for(total), total)
    ramp = [factor(step) for step in range(warmup + 1)]
    assert ramp == sorted(ramp) and ramp[-1] == 1.0  # rises for `warmup` steps, peaks right after
    assert factor(total) == 0.0


def test_spec_hash_unchanged_for_specs_not_using_the_new_fields() -> None:
    # hash of this spec before warmup_ratio existed: checkpoints of jobs in
    # flight across the upgrade must still resume
    spec = parse_spec(_spec(warmup_steps=3, eval_every_steps=5))
    assert spec_hash(spec) == "sha256:c15a6a35417cbf3147ea4d5ed1b6d2993ceb8ded58548408ca1f2fc58018fed9"
    assert spec_hash(parse_spec(_spec(warmup_ratio=0.1, eval_every_steps=5))) != spec_hash(spec)
