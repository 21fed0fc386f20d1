"""Detectors for sick jobs: pure rules over what the gateway knows of one running job.

``check`` reads the job's ``progress`` watch fields, which ``services.progress`` keeps from the
trainer's events (``window``: the recent steps as [unix, step, loss, tokens/s, attempt];
``seen_at``: when the gateway last read a new line, on its own clock; ``checkpoint_at``: when
it saw the newest checkpoint and its step), and returns its findings. The reconciler runs it
each cycle for a RUNNING job, raises each finding once per attempt as a ``warning`` event and
counts it, and carries out the one action a rule may ask for: requeue a stalled job, which
resumes from its newest checkpoint (the gap a slurmd restart leaves: Slurm keeps a job whose
processes died RUNNING until its time limit).

Rules (each a function of its own below):
- stall: no new line (step, heartbeat, phase) for ``stall_factor`` x the job's median step
  time, and at least ``stall_min_s``; ``stall_requeue_s`` later still silent: requeue.
- checkpoint lag: ``checkpoint_lag_factor`` x the planned interval of steps without a new
  checkpoint; and, when the time limit is near (under 2 x the requeue grace), a newest
  checkpoint older than that grace (the work since then would be lost).
- throughput collapse: the last ``throughput_window`` steps all under half the job's own
  median tokens/s over the steps before them.
- loss divergence: the newest loss beyond ``divergence_z`` robust standard deviations (MAD)
  of the window before it. (A non-finite loss stops the trainer itself, as a user error.)
- eval spread: the newest eval's standard error over its rows beyond ``eval_spread_factor`` x
  the median of the evals before it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Limits:
    stall_factor: float = 20.0
    stall_min_s: float = 300.0
    stall_requeue_s: float = 300.0
    checkpoint_lag_factor: float = 2.0
    throughput_window: int = 5
    throughput_min_history: int = 10
    divergence_z: float = 8.0
    divergence_min_history: int = 10
    eval_spread_factor: float = 3.0
    eval_spread_min_history: int = 2


@dataclass(frozen=True)
class Finding:
    rule: str        # stall | stall_requeue | checkpoint_lag | checkpoint_stale | throughput | divergence | eval_spread
    message: str
    requeue: bool = False


@dataclass(frozen=True)
class Step:
    unix: float
    step: int
    loss: float | None
    tokens_per_s: float | None
    attempt: int


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def window(progress: dict[str, Any], attempt: int) -> list[Step]:
    """The recent steps of ``attempt`` from ``progress["window"]`` (malformed entries left out), by step."""
    out = []
    for row in progress.get("window") or []:
        if not (isinstance(row, list) and len(row) == 5):
            continue
        unix, step, loss, tps, att = row
        if _num(unix) is None or not isinstance(step, int) or att != attempt:
            continue
        out.append(Step(float(unix), step, _num(loss), _num(tps), attempt))
    return sorted(out, key=lambda s: s.step)


def median_step_s(steps: list[Step]) -> float | None:
    """The median seconds per step between consecutive recorded steps, or None under 3 steps."""
    per = [(b.unix - a.unix) / (b.step - a.step) for a, b in zip(steps, steps[1:], strict=False)
           if b.step > a.step and b.unix >= a.unix]
    return statistics.median(per) if len(per) >= 2 else None


def stall(steps: list[Step], seen_at: float | None, now: float, limits: Limits) -> Finding | None:
    """No new line for stall_factor x the median step time (at least stall_min_s)."""
    if seen_at is None:
        return None
    m = median_step_s(steps)
    threshold = max(limits.stall_min_s, limits.stall_factor * m if m else 0.0)
    silent = now - seen_at
    if silent < threshold:
        return None
    if silent >= threshold + limits.stall_requeue_s:
        return Finding("stall_requeue", f"the job has been silent for {silent:.0f} s: requeued; it resumes "
                                        "from its newest checkpoint", requeue=True)
    basis = f"{limits.stall_factor:g} x its median step time of {m:.2f} s" if m else "the floor"
    return Finding("stall", f"no step, heartbeat or phase from the trainer for {silent:.0f} s (over {basis}, "
                            f"{threshold:.0f} s); it is requeued if it stays silent "
                            f"{limits.stall_requeue_s:.0f} s more")


def checkpoint_lag(steps: list[Step], checkpoint: tuple[float, int] | None, every: int,
                   time_left_s: float | None, grace_s: float, now: float, limits: Limits) -> list[Finding]:
    """Too many steps since the newest checkpoint; and near the time limit, a checkpoint older than the grace."""
    out = []
    last_step = steps[-1].step if steps else None
    done = checkpoint[1] if checkpoint else 0
    if last_step is not None and every > 0 and last_step - done >= limits.checkpoint_lag_factor * every:
        out.append(Finding("checkpoint_lag", f"{last_step - done} steps since the newest checkpoint (step {done}); "
                                             f"one was planned every {every}: storage may be failing or slow"))
    since = now - checkpoint[0] if checkpoint else None
    if time_left_s is not None and time_left_s < 2 * grace_s and (since is None or since > grace_s):
        age = f"{since:.0f} s old" if since is not None else "none yet"
        out.append(Finding("checkpoint_stale", f"the time limit is {time_left_s:.0f} s away and the newest "
                                               f"checkpoint is {age}: work since then is lost if the final "
                                               "checkpoint does not make it"))
    return out


def throughput(steps: list[Step], limits: Limits) -> Finding | None:
    """The last throughput_window steps all under half the median tokens/s of the steps before them."""
    rates = [s.tokens_per_s for s in steps if s.tokens_per_s is not None and s.tokens_per_s > 0]
    n = limits.throughput_window
    if len(rates) < limits.throughput_min_history + n:
        return None
    base = statistics.median(rates[:-n])
    recent = rates[-n:]
    if all(r < 0.5 * base for r in recent):
        return Finding("throughput", f"tokens/s fell to {statistics.median(recent):.0f} over the last {n} steps, "
                                     f"under half the job's own median of {base:.0f}: a slow node, GPU "
                                     "throttling or contention")
    return None


def divergence(steps: list[Step], limits: Limits) -> Finding | None:
    """The newest loss beyond divergence_z robust standard deviations of the ones before it."""
    losses = [s.loss for s in steps if s.loss is not None]
    if len(losses) < limits.divergence_min_history + 1:
        return None
    *before, last = losses
    med = statistics.median(before)
    mad = statistics.median(abs(x - med) for x in before) * 1.4826
    if mad > 0 and last > med + limits.divergence_z * mad:
        return Finding("divergence", f"the training loss jumped to {last:.4f}, {(last - med) / mad:.1f} robust "
                                     f"standard deviations above its recent median {med:.4f}: the learning rate "
                                     "may be too high")
    return None


def eval_spread(progress: dict[str, Any], limits: Limits) -> Finding | None:
    """The newest eval's standard error (over its rows) beyond eval_spread_factor x the median of the
    ones before it (at least eval_spread_min_history of them): a few examples now dominate the loss."""
    raw = [_num(e.get("loss_stderr")) for e in progress.get("evals") or [] if isinstance(e, dict)]
    errs = [x for x in raw if x is not None]
    if len(errs) < limits.eval_spread_min_history + 1:
        return None
    *before, last = errs
    base = statistics.median(before)
    if base > 0 and last > limits.eval_spread_factor * base:
        return Finding("eval_spread", f"the newest eval's standard error is {last:.4f}, {last / base:.1f} x its "
                                      f"median {base:.4f} over the evals before: a few validation examples "
                                      "now dominate the loss (a collapse on some inputs, or bad rows)")
    return None


def check(progress: dict[str, Any], *, attempt: int, now: float, checkpoint_every: int,
          time_left_s: float | None, grace_s: float, limits: Limits,
          running_since: float | None = None) -> list[Finding]:
    """Every rule's findings for a RUNNING job (see the module doc); ``running_since``: when Slurm
    started its current run (silence counts from then at the earliest: a requeued run starts silent)."""
    steps = window(progress, attempt)
    seen = _num(progress.get("seen_at"))
    if running_since is not None:
        seen = max(seen or running_since, running_since)
    raw = progress.get("checkpoint_at")
    checkpoint = (float(raw[0]), int(raw[1])) if isinstance(raw, list) and len(raw) == 2 \
        and _num(raw[0]) is not None and isinstance(raw[1], int) else None
    found = [f for f in (stall(steps, seen, now, limits), throughput(steps, limits), divergence(steps, limits),
                         eval_spread(progress, limits)) if f is not None]
    return found + checkpoint_lag(steps, checkpoint, checkpoint_every, time_left_s, grace_s, now, limits)
