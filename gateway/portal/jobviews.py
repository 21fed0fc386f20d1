"""Pure helpers for the job pages: the create form, badges, progress, events and loss series."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from gateway.models import FineTuningJob, JobEvent
from gateway.services.jobcreate import METHODS, JobRequest
from gateway.state import ACTIVE, JobState
from trainer.contract.spec import HYPERPARAMETER_BOUNDS, HYPERPARAMETER_DEFAULTS, JOB_BOUNDS, Bounds

ACTIVE_STATES = frozenset(s.value for s in ACTIVE)
BADGES: dict[str, str] = {JobState.VALIDATING_FILES: "wait", JobState.QUEUED: "wait",
                          JobState.RUNNING: "run", JobState.PAUSED: "warn",
                          JobState.PUBLISHING: "run", JobState.CANCELLING: "warn", JobState.SUCCEEDED: "ok",
                          JobState.CANCELLED: "muted", JobState.FAILED: "bad"}


def badge(status: str | None) -> str:
    """The CSS modifier of a status badge."""
    return BADGES.get(status or "", "muted")


@dataclass
class JobForm:
    """The create form's values as typed (strings), so a refused form comes back as it was sent."""

    model: str = ""
    method: str = "supervised"
    beta: str = ""
    training_file: str = ""
    validation_file: str = ""
    epochs: str = str(HYPERPARAMETER_DEFAULTS["epochs"])
    learning_rate: str = f"{HYPERPARAMETER_DEFAULTS['learning_rate']:g}"
    lora_r: str = str(HYPERPARAMETER_DEFAULTS["lora_r"])
    suffix: str = ""
    batch_size_tokens: str = ""
    max_seq_len: str = ""
    checkpoint_every_steps: str = ""
    idempotency_key: str = ""
    FIELDS: ClassVar[frozenset[str]] = frozenset()

    def epochs_value(self) -> int | None:
        """``epochs`` as an int in the contract's range; None when it is not one."""
        return _int(self.epochs, *INT_FIELDS["epochs"])


JobForm.FIELDS = frozenset(f.name for f in fields(JobForm))
_BOUNDS: dict[str, Bounds] = {**{k: HYPERPARAMETER_BOUNDS[k] for k in ("epochs", "lora_r", "batch_size_tokens",
                                                                      "max_seq_len", "learning_rate", "beta")},
                              "checkpoint_every_steps": JOB_BOUNDS["checkpoint_every_steps"]}
INT_FIELDS = {k: (int(_BOUNDS[k].low or 0), int(_BOUNDS[k].high or 0))
              for k in ("epochs", "lora_r", "batch_size_tokens", "max_seq_len", "checkpoint_every_steps")}
"""The form's whole-number fields and their ranges (the contract's: closed at both ends)."""
FORM_LIMITS = {**INT_FIELDS, **{k: (_BOUNDS[k].low, _BOUNDS[k].high) for k in ("learning_rate", "beta")}}
"""Every bounded field's (low, high), for the template's min/max and placeholders."""
OPTIONAL = ("batch_size_tokens", "max_seq_len", "checkpoint_every_steps")


def _int(raw: str, lo: int, hi: int) -> int | None:
    try:
        value = int(raw.strip())
    except ValueError:
        return None
    return value if lo <= value <= hi else None


def _float(raw: str, name: str) -> float | None:
    """``raw`` as a float in the contract's range of ``name``; None when it is not one."""
    try:
        value = float(raw.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and _BOUNDS[name].contains(value) else None


def _float_error(name: str) -> str:
    """What to enter for the float field ``name`` (its range and default, from the contract)."""
    b = _BOUNDS[name]
    return (f"Enter a number {'above' if b.low_open else 'from'} {b.low:g} and at most {b.high:g}, "
            f"e.g. {HYPERPARAMETER_DEFAULTS[name]:g}.")


def parse_job_form(raw: dict[str, str]) -> tuple[JobForm, JobRequest | None, dict[str, str]]:
    """(the form as sent, the request or None, field → error message)."""
    form = JobForm(**{k: raw.get(k, "").strip()[:200] for k in JobForm.FIELDS if k in raw})
    errors: dict[str, str] = {}
    hp: dict[str, Any] = {}
    for name, (lo, hi) in INT_FIELDS.items():
        text = getattr(form, name)
        if name in OPTIONAL and not text:
            continue
        value = _int(text, lo, hi)
        if value is None:
            errors[name] = f"Enter a whole number from {lo:,} to {hi:,}."
        else:
            hp[name] = value
    lr = _float(form.learning_rate, "learning_rate")
    if lr is None:
        errors["learning_rate"] = _float_error("learning_rate")
    else:
        hp["learning_rate"] = lr
    if form.method not in METHODS:
        errors["method"] = "Choose supervised or DPO."
    if form.beta and form.method != "dpo":
        errors["beta"] = "Beta applies to DPO only: choose the DPO method, or leave it empty."
    elif form.beta:
        beta = _float(form.beta, "beta")
        if beta is None:
            errors["beta"] = _float_error("beta")
        else:
            hp["beta"] = beta
    if not form.model:
        errors["model"] = "Choose a base model."
    if not form.training_file:
        errors["training_file"] = "Choose a training file (upload one on the Datasets page first)."
    if form.validation_file and form.validation_file == form.training_file:
        errors["validation_file"] = "Use a different file than the training file, or none."
    if form.suffix and (len(form.suffix) > 64 or not all(c.isascii() and (c.isalnum() or c in "_.-")
                                                         for c in form.suffix)):
        errors["suffix"] = "Up to 64 letters, digits, '.', '_' or '-'."
    if errors:
        return form, None, errors
    req = JobRequest(training_file=form.training_file, model=form.model,
                     validation_file=form.validation_file or None, hyperparameters=hp,
                     suffix=form.suffix or None, idempotency_key=form.idempotency_key or None,
                     method=form.method)
    return form, req, errors


def progress_view(job: FineTuningJob) -> dict[str, Any]:
    """Step, total, percent (or None before training reports), loss, throughput."""
    p = job.progress or {}
    step, total = p.get("step"), p.get("total_steps")
    pct = None
    if isinstance(step, int) and isinstance(total, int) and total > 0:
        pct = min(100, round(100 * step / total))
    if job.status == JobState.SUCCEEDED:
        pct = 100
    evals = {e.get("when"): e for e in p.get("evals") or [] if isinstance(e, dict)}
    preference = None
    if job.method == "dpo" and "before" in evals:   # held-out reward accuracy and margin, before -> after
        preference = {when: {k: evals[when].get(k) for k in ("reward_accuracy", "reward_margin")}
                      for when in ("before", "after") if when in evals}
    return {"step": step, "total": total, "pct": pct, "loss": p.get("loss"),
            "tokens_per_s": p.get("tokens_per_s"), "epoch": p.get("epoch"), "preference": preference}


def job_events(events: list[JobEvent]) -> list[JobEvent]:
    """Newest first; step-by-step metrics beyond the latest few are left to the chart."""
    out, metrics = [], 0
    for ev in events:
        if ev.type == "metrics" and "train_loss" in (ev.data or {}):
            metrics += 1
            if metrics > 3:
                continue
        out.append(ev)
    return out


def loss_series(events: list[JobEvent]) -> dict[str, list[list[float]]]:
    """{"train": [[step, loss], ...], "eval": [...]} in step order, from the job's metric events."""
    train: dict[int, float] = {}
    evals: dict[int, float] = {}
    for ev in events:
        data = ev.data or {}
        step = data.get("step")
        if ev.type != "metrics" or not isinstance(step, int):
            continue
        if isinstance(data.get("train_loss"), int | float):
            train.setdefault(step, float(data["train_loss"]))
        if isinstance(data.get("valid_loss"), int | float):
            evals.setdefault(step, float(data["valid_loss"]))
    return {"train": [[s, v] for s, v in sorted(train.items())],
            "eval": [[s, v] for s, v in sorted(evals.items())]}

