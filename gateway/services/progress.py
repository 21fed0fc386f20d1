"""The trainer's progress events: a job's ``events.jsonl`` lines turned into its row.

Owns reading those lines (written by the tenant's job, so untrusted) into the job's
progress, phase, attempt, trained tokens, estimated finish, checkpoints and event list,
and the trainer's own failure message. Imports the models and ``services.jobwrites`` only;
the reconciler reads the bytes (through storage) and calls ``ingest_events``.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

from sqlmodel import Session

from gateway.models import FineTuningJob, JobCheckpoint, utcnow
from gateway.services.jobwrites import add_event, update_fields
from gateway.storage.verbs import tenant_json

DPO_EVAL = ("reward_margin", "reward_accuracy", "logp_accuracy", "chosen_reward", "rejected_reward")
"""The eval record's DPO metrics (trainer.dpo.preference_metrics), kept in the job's progress."""

EVAL_WHEN = ("before", "step", "after")
"""When the trainer evaluates (its eval record's ``when``): before training, every ``eval_every_steps``, at the end."""

# trainer phases → the job's phase ("saving", and DPO's "reference" pass, are shown as the evaluating phase)
PHASES = {"tokenizing": "tokenizing", "reference": "evaluating", "training": "training",
          "evaluating": "evaluating", "saving": "evaluating"}


def ingest_events(*, session: Session, job: FineTuningJob, data: bytes) -> None:
    """Apply the complete lines of ``data`` (events.jsonl from the job's offset) to ``job`` and
    move its offset past them; a line that is not a JSON object is skipped, an unfinished last
    line is left for the next read. Raises StaleJob if another writer changed the job."""
    end = data.rfind(b"\n")
    if end < 0:
        return
    progress = dict(job.progress or {})
    progress["seen_at"] = round(time.time(), 3)      # the detectors' clock: the gateway's, not the job's
    changes: dict[str, Any] = {}
    for line in data[:end + 1].splitlines():
        try:
            ev = tenant_json(line, "event")      # the tenant's bytes: depth-checked before parsing
        except ValueError:
            continue
        if not isinstance(ev, dict):
            continue
        _one_event(session, job, ev, progress, changes)
        watch(ev, progress)
    changes["progress"] = progress
    changes["events_offset"] = job.events_offset + end + 1
    update_fields(session, job, **changes)


WINDOW = 64      # recent steps the detectors see (gateway.jobs.detectors)


def watch(ev: dict[str, Any], progress: dict[str, Any]) -> None:
    """Keep what the detectors read: the recent steps, and when the newest checkpoint was seen."""
    step = _int(ev.get("step"))
    if ev.get("type") == "metrics" and step is not None:
        row = [_num(ev.get("unix")) or round(time.time(), 3), step, _num(ev.get("loss")),
               _num(ev.get("tokens_per_s")), _int(ev.get("attempt")) or 0]
        progress["window"] = [*(progress.get("window") or [])[-(WINDOW - 1):], row]
    elif ev.get("type") == "checkpoint" and step is not None:
        progress["checkpoint_at"] = [round(time.time(), 3), step]


def trainer_failure(job: FineTuningJob) -> str | None:
    """The failure message the trainer reported in its events, or None."""
    failure = (job.progress or {}).get("failure") or {}
    msg = failure.get("message")
    return f"{msg}" if msg else None


def _num(value: Any) -> float | None:
    """``value`` as a finite float when it is a JSON number, else None (the lines are untrusted)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _int(value: Any) -> int | None:
    """``value`` when it is a JSON integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _loss(value: Any) -> str:
    """A loss for an event message: four decimals, or "?" for anything that is not a number."""
    n = _num(value)
    return f"{n:.4f}" if n is not None else "?"


def _one_event(s: Session, job: FineTuningJob, ev: dict[str, Any], progress: dict[str, Any],
               changes: dict[str, Any]) -> None:
    kind = ev.get("type")
    attempt = ev.get("attempt")
    if isinstance(attempt, int) and attempt > changes.get("attempt", job.attempt):
        changes["attempt"] = attempt
        add_event(s, job.id, f"Attempt {attempt} started (requeued run resumes from its checkpoint)")
    if kind == "phase" and ev.get("phase") in PHASES:
        changes["phase"] = PHASES[ev["phase"]]
        add_event(s, job.id, f"Phase: {ev['phase']}", data={"phase": ev["phase"]})
    elif kind == "metrics":
        _metrics(s, job, ev, progress, changes)
    elif kind == "eval":
        dpo = {k: _num(ev.get(k)) for k in DPO_EVAL if k in ev}
        progress.setdefault("evals", []).append(
            {**{k: ev.get(k) for k in ("when", "step", "loss", "perplexity", "token_accuracy")},
             **({"loss_stderr": ev["loss_stderr"]} if "loss_stderr" in ev else {}), **dpo})
        extra = (f", reward accuracy={_loss(dpo.get('reward_accuracy'))}, "
                 f"reward margin={_loss(dpo.get('reward_margin'))}") if dpo else ""
        add_event(s, job.id, f"Eval ({ev.get('when')}, step {_int(ev.get('step'))}): loss={_loss(ev.get('loss'))}"
                  f"{extra}", type_="metrics",
                  data={"step": ev.get("step"), "when": ev.get("when") if ev.get("when") in EVAL_WHEN else None,
                        "valid_loss": ev.get("loss"),
                        "valid_mean_token_accuracy": ev.get("token_accuracy"),
                        **{f"valid_{k}": v for k, v in dpo.items()}})
    elif kind == "checkpoint":
        s.add(JobCheckpoint(job_id=job.id, attempt=_int(ev.get("attempt")) or 0, step=_int(ev.get("step")) or 0,
                            path=str(ev.get("path", "")),
                            metrics={"train_loss": progress.get("loss"), "step": ev.get("step")}))
        add_event(s, job.id, f"Checkpoint saved at step {_int(ev.get('step'))}")
        _pruned(ev, progress)
    elif kind == "early_stop":
        stop = {"step": _int(ev.get("step")), "best_step": _int(ev.get("best_step")),
                "best_loss": _num(ev.get("best_loss"))}
        progress["early_stop"] = stop
        add_event(s, job.id, f"Early stopping at step {stop['step']}: validation loss stopped improving; "
                  f"the adapter of step {stop['best_step']} (loss {_loss(stop['best_loss'])}) is published",
                  data=stop)
    elif kind == "stopped":
        add_event(s, job.id, f"Trainer stopped by {ev.get('signal')} at step {ev.get('step')} "
                  f"(checkpoint {ev.get('checkpoint_step')})")
    elif kind == "failed":
        progress["failure"] = {"reason": ev.get("reason"), "message": ev.get("message")}


MAX_PRUNED_STEPS = 1000     # the trainer's prune report kept in a job's progress (its lines are untrusted)


def _pruned(ev: dict[str, Any], progress: dict[str, Any]) -> None:
    """Keep what the trainer says its pruning removed while training (``checkpoints_pruned``: steps, bytes):
    the tenant's own process's figures, shown as such beside the gateway's (``services.retention``)."""
    steps = [n for n in ev.get("pruned") or [] if _int(n) is not None] if isinstance(ev.get("pruned"), list) else []
    size = _int(ev.get("pruned_bytes"))
    if not steps and not size:
        return
    seen = progress.get("checkpoints_pruned") or {}
    progress["checkpoints_pruned"] = {
        "steps": sorted(set(seen.get("steps") or []) | set(steps))[-MAX_PRUNED_STEPS:],
        "bytes": int(seen.get("bytes") or 0) + max(size or 0, 0)}


def _metrics(s: Session, job: FineTuningJob, ev: dict[str, Any], progress: dict[str, Any],
             changes: dict[str, Any]) -> None:
    step, total = ev.get("step"), ev.get("total_steps")
    progress.update({k: ev.get(k) for k in ("step", "total_steps", "loss", "lr", "tokens_per_s",
                                            "elapsed_s", "epoch")})
    # trained_tokens = tokens of every distinct step (a resumed attempt redoes a few)
    if isinstance(step, int) and isinstance(ev.get("tokens"), int) and step > progress.get("counted_step", 0):
        progress["counted_step"] = step
        changes["trained_tokens"] = changes.get("trained_tokens", job.trained_tokens or 0) + ev["tokens"]
    elapsed = _num(ev.get("elapsed_s"))
    if isinstance(step, int) and isinstance(total, int) and step > 0 and elapsed:
        left = max(0.0, min((total - step) * elapsed / step, 366 * 86400.0))
        changes["estimated_finish"] = utcnow() + timedelta(seconds=left)
    dpo = {f"train_{k}": _num(ev.get(k)) for k in ("reward_margin", "reward_accuracy") if k in ev}
    add_event(s, job.id, f"Step {_int(step)}/{_int(total)}: training loss={_loss(ev.get('loss'))}",
              type_="metrics", data={"step": step, "total_steps": total,
                                     "train_loss": ev.get("loss"), "lr": _num(ev.get("lr")),
                                     "tokens_per_s": ev.get("tokens_per_s"), **dpo})
