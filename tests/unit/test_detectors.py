"""The detectors' rules over a recorded event stream (a real job of the dev cluster: paused at step
12, resumed as attempt 1, 232 steps) fed through the gateway's own ingestion, firing and not firing."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.jobs import detectors as d
from gateway.services.progress import WINDOW, watch

DATA = Path(__file__).resolve().parents[1] / "data"
LIMITS = d.Limits(stall_factor=20, stall_min_s=60, stall_requeue_s=120)


@pytest.fixture(scope="module")
def recorded() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    events = [json.loads(line) for line in (DATA / "events_pause_resume.jsonl").read_text().splitlines()]
    progress: dict[str, Any] = {}
    for ev in events:
        watch(ev, progress)
    progress["seen_at"] = events[-1]["unix"]
    return progress, events


def _with_steps(progress: dict[str, Any], rows: list[list[Any]]) -> dict[str, Any]:
    out = copy.deepcopy(progress)
    out["window"] = [*out["window"], *rows][-WINDOW:]
    return out


def _check(progress: dict[str, Any], now: float, **kw: Any) -> list[str]:
    args = {"attempt": 1, "checkpoint_every": 50, "time_left_s": None, "grace_s": 90.0, **kw}
    return [f.rule for f in d.check(progress, now=now, limits=LIMITS, **args)]


def test_the_recorded_job_is_healthy(recorded: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    progress, events = recorded
    steps = d.window(progress, 1)
    assert len(steps) == WINDOW and steps[-1].step == 232 and d.window(progress, 0) == []
    m = d.median_step_s(steps)
    assert m is not None and 0.01 < m < 1.0
    # a healthy run, a second after its last line: nothing fires (its loss falls, its rate is steady)
    assert _check(progress, events[-1]["unix"] + 1, checkpoint_every=500) == []


def test_stall_warns_then_requeues(recorded: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    progress, _ = recorded
    seen = progress["seen_at"]
    assert "stall" not in _check(progress, seen + 59)                  # under the floor (the median is ~0.1 s)
    assert _check(progress, seen + 61, checkpoint_every=500) == ["stall"]
    found = d.check(progress, attempt=1, now=seen + 181, checkpoint_every=500, time_left_s=None, grace_s=90,
                    limits=LIMITS)
    assert [(f.rule, f.requeue) for f in found] == [("stall_requeue", True)]
    slow = d.Limits(stall_factor=20, stall_min_s=1, stall_requeue_s=120)   # the job's own pace sets it
    m = d.median_step_s(d.window(progress, 1))
    assert m is not None
    assert d.stall(d.window(progress, 1), seen, seen + 20 * m * 0.9, slow) is None
    assert d.stall(d.window(progress, 1), seen, seen + 20 * m * 1.1 + 1, slow) is not None
    # a run Slurm (re)started 30 s ago is silent only since then
    assert d.check(progress, attempt=1, now=seen + 181, checkpoint_every=500, time_left_s=None, grace_s=90,
                   limits=LIMITS, running_since=seen + 151) == []


def test_throughput_collapse(recorded: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    progress, _ = recorded
    last = progress["window"][-1]
    rate = d.statistics.median(r[3] for r in progress["window"])

    def tail(factor: float) -> list[list[Any]]:
        return [[last[0] + i, last[1] + i, last[2], rate * factor, 1] for i in range(1, 6)]

    now = last[0] + 6
    assert "throughput" not in _check(_with_steps(progress, tail(0.7)), now, checkpoint_every=500)
    assert "throughput" in _check(_with_steps(progress, tail(0.3)), now, checkpoint_every=500)
    one_slow = tail(0.3)
    one_slow[2][3] = rate            # one step at the old pace: not sustained
    assert "throughput" not in _check(_with_steps(progress, one_slow), now, checkpoint_every=500)


def test_loss_divergence(recorded: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    progress, _ = recorded
    last = progress["window"][-1]
    losses = [r[2] for r in progress["window"]]
    spread = max(losses[-20:]) - min(losses[-20:])
    now = last[0] + 1
    mild = [[last[0] + 0.5, last[1] + 1, max(losses[-20:]) + 0.1 * spread, last[3], 1]]
    assert "divergence" not in _check(_with_steps(progress, mild), now, checkpoint_every=500)
    jump = [[last[0] + 0.5, last[1] + 1, last[2] + 50.0, last[3], 1]]
    assert "divergence" in _check(_with_steps(progress, jump), now, checkpoint_every=500)


def test_checkpoint_lag_and_a_stale_checkpoint_near_the_time_limit(
        recorded: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    progress, _ = recorded
    assert progress["checkpoint_at"][1] == 12          # the pause's checkpoint; 220 steps since
    now = progress["seen_at"] + 1
    assert _check(progress, now, checkpoint_every=500) == []
    assert _check(progress, now, checkpoint_every=100) == ["checkpoint_lag"]     # 220 >= 2 x 100
    seen_ckpt = progress["checkpoint_at"][0]
    assert "checkpoint_stale" in _check(progress, seen_ckpt + 100, checkpoint_every=500, time_left_s=150)
    assert "checkpoint_stale" not in _check(progress, seen_ckpt + 80, checkpoint_every=500, time_left_s=150)
    assert "checkpoint_stale" not in _check(progress, seen_ckpt + 100, checkpoint_every=500, time_left_s=200)


def test_malformed_watch_fields_are_ignored() -> None:
    progress = {"window": [[1.0, "x", None, None, 0], "junk", [float("nan"), 1, 1.0, 1.0, 0]],
                "seen_at": "yesterday", "checkpoint_at": ["a", 1]}
    assert d.window(progress, 0) == [] and d.check(progress, attempt=0, now=1e10, checkpoint_every=1,
                                                   time_left_s=None, grace_s=90, limits=LIMITS) == []


def test_eval_spread() -> None:
    def evals(*errs: float | None) -> dict[str, Any]:
        return {"evals": [{"when": "step", "step": 4 * i, "loss": 6.0, "loss_stderr": e} for i, e in enumerate(errs)]}

    assert d.eval_spread(evals(0.05, 0.06), LIMITS) is None                      # too few evals before it
    assert d.eval_spread(evals(0.05, 0.06, 0.055, 0.07), LIMITS) is None         # a normal wobble
    found = d.eval_spread(evals(0.05, 0.06, 0.055, 0.4), LIMITS)
    assert found is not None and found.rule == "eval_spread" and not found.requeue
    assert d.eval_spread(evals(None, 0.05, None, 0.06, 0.4), LIMITS) is not None  # evals of older trainers skipped
    assert d.eval_spread({"evals": ["junk", {"loss_stderr": "x"}]}, LIMITS) is None
