"""Spec rules and pure pieces of warm-up and early stopping (no training)."""

from __future__ import annotations

import pytest

from trainer.contract.errors import SpecError
from trainer.contract.spec import Hyperparameters, parse_spec, spec_hash
from trainer.model import lr_lambda
from trainer.recipe import improves

pytestmark = pytest.mark.unit


def _spec(**hyper: object) -> dict[str, object]:
    return {
        "base_model": {"name": "tiny", "digest": "sha256:" + "a" * 64, "catalog_root": "/models"},
        "train": {"path": "/d/train.jsonl", "sha256": "b" * 64},
        "job_dir": "/jobs/1",
        "hyperparameters": hyper,
    }


def test_early_stopping_without_periodic_evals_is_refused() -> None:
    with pytest.raises(SpecError, match=r"early_stopping_patience \(3\) needs eval_every_steps"):
        parse_spec(_spec(early_stopping_patience=3))
    spec = parse_spec(_spec(early_stopping_patience=3, eval_every_steps=50, early_stopping_min_delta=0.01))
    assert spec.hyperparameters.early_stopping_patience == 3


def test_min_delta_without_patience_is_refused() -> None:
    with pytest.raises(SpecError, match=r"early_stopping_min_delta \(0.1\) does nothing without"):
        parse_spec(_spec(early_stopping_min_delta=0.1, eval_every_steps=5))


@pytest.mark.parametrize(("field", "value"), [("early_stopping_patience", 0), ("warmup_ratio", 0.6)])
def test_new_fields_name_their_range(field: str, value: object) -> None:
    with pytest.raises(SpecError, match=f"hyperparameters.{field}.*allowed range"):
        parse_spec(_spec(**{field: value, "eval_every_steps": 5}))


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


def test_improvement_needs_more_than_min_delta() -> None:
    assert improves(5.0, None, 0.5)  # the first eval always sets the best
    assert improves(4.4, 5.0, 0.5) and not improves(4.5, 5.0, 0.5)
    assert not improves(5.0, 5.0, 0.0) and improves(4.999, 5.0, 0.0)


def test_spec_hash_unchanged_for_specs_not_using_the_new_fields() -> None:
    # hash of this spec before warmup_ratio/early stopping existed: checkpoints of jobs in
    # flight across the upgrade must still resume
    spec = parse_spec(_spec(warmup_steps=3, eval_every_steps=5))
    assert spec_hash(spec) == "sha256:c15a6a35417cbf3147ea4d5ed1b6d2993ceb8ded58548408ca1f2fc58018fed9"
    assert spec_hash(parse_spec(_spec(warmup_ratio=0.1, eval_every_steps=5))) != spec_hash(spec)
