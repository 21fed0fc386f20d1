"""OpenAI's hyperparameter names and ours: the one place a request's names are translated.

A request may name a hyperparameter as OpenAI's fine-tuning API does (``n_epochs``,
``learning_rate_multiplier``, ``batch_size``; ``"auto"``, or leaving it out, has the gateway choose it
from the data and the base model: ``gateway.services.autohp``) or as the trainer's
spec does (``trainer.contract.spec.Hyperparameters``: ``epochs``, ``learning_rate``,
``batch_size_tokens``...). The routes translate to ours here (:func:`to_ours`: a job's, a sweep's shared ones and each
point of its grid) before anything reaches a service, and ``job_object`` gives OpenAI's names back
(:func:`to_openai`: the resolved numbers, as OpenAI shows them); services, the database and the
spec know only ours (a sweep's grid is recorded as the request gave it, and shown so). The numbers (the
base learning rate behind a multiplier of 1, the epochs' range, beta's default) are the
contract's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gateway.errors import ServiceError
from gateway.services.jobspec import AUTO as RECORD
from gateway.services.jobspec import whole_epochs
from trainer.contract.spec import HYPERPARAMETER_DEFAULTS

BASE_LEARNING_RATE: float = HYPERPARAMETER_DEFAULTS["learning_rate"]
"""What ``learning_rate_multiplier`` multiplies: our default learning rate (a multiplier of 1 is it)."""

AUTO = "auto"
EPOCHS = "n_epochs"
MULTIPLIER = "learning_rate_multiplier"
BATCH_SIZE = "batch_size"   # examples per batch: we pack by tokens (batch_size_tokens), so a request's is ignored
OURS = {EPOCHS: "epochs", MULTIPLIER: "learning_rate"}
"""OpenAI's names that have one of ours (``batch_size`` has none)."""
NAMES = (EPOCHS, MULTIPLIER, BATCH_SIZE)


def _multiplier(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ServiceError(f"{param} must be a positive number", param=param)
    return BASE_LEARNING_RATE * value


def to_ours(raw: Mapping[str, Any], param: str = "hyperparameters") -> dict[str, Any]:
    """A request's hyperparameters with our names: ``"auto"`` values left out (chosen at create: ``autohp``),
    ``n_epochs`` → ``epochs`` (a whole number in the contract's range), ``learning_rate_multiplier`` → ``learning_rate``
    (times :data:`BASE_LEARNING_RATE`), ``batch_size`` dropped; our own names pass as they are
    (the spec checks them). ServiceError (400) naming the field for a bad multiplier or epochs."""
    hp = {k: v for k, v in raw.items() if v != AUTO}
    if EPOCHS in hp:
        hp["epochs"] = whole_epochs(hp.pop(EPOCHS), f"{param}.{EPOCHS}")
    if MULTIPLIER in hp:
        hp["learning_rate"] = _multiplier(hp.pop(MULTIPLIER), f"{param}.{MULTIPLIER}")
    hp.pop(BATCH_SIZE, None)
    return hp


def to_openai(hp: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's ``hyperparameters`` of a job whose recorded (our) hyperparameters are ``hp``, as numbers:
    ``n_epochs``, ``batch_size`` (the examples-equivalent of a step's ``batch_size_tokens``, recorded by
    ``autohp`` at create) and ``learning_rate_multiplier`` (the learning rate over :data:`BASE_LEARNING_RATE`,
    so that giving it back trains at the same rate). A job recorded before ``auto`` was chosen shows
    ``"auto"`` for what it did not record."""
    lr = hp.get("learning_rate")
    record = hp.get(RECORD)
    if not isinstance(record, Mapping):
        record = {}
    return {EPOCHS: hp.get("epochs", HYPERPARAMETER_DEFAULTS["epochs"]), BATCH_SIZE: record.get("batch_size", AUTO),
            MULTIPLIER: (lr / BASE_LEARNING_RATE) if lr else AUTO}


def ours_shown(hp: Mapping[str, Any]) -> dict[str, Any]:
    """A job's recorded hyperparameters as the job object's method block shows ours: without the
    gateway's record of what ``auto`` chose."""
    return {k: v for k, v in hp.items() if k != RECORD}
