"""The job state machine, exhaustively."""

from __future__ import annotations

import itertools

import pytest

from gateway.jobstate import (
    ACTIVE,
    TERMINAL,
    TRANSITIONS,
    Event,
    FailReason,
    IllegalTransition,
    JobState,
    from_slurm,
    transition,
)

S, E = JobState, Event
EXPECTED = {
    (S.VALIDATING_FILES, E.SUBMITTED): S.QUEUED,
    (S.QUEUED, E.STARTED): S.RUNNING, (S.QUEUED, E.REQUEUED): S.QUEUED,
    (S.QUEUED, E.COMPLETED): S.PUBLISHING,
    (S.RUNNING, E.STARTED): S.RUNNING, (S.RUNNING, E.REQUEUED): S.QUEUED,
    (S.RUNNING, E.COMPLETED): S.PUBLISHING,
    (S.PUBLISHING, E.PUBLISHED): S.SUCCEEDED,
    (S.CANCELLING, E.CANCEL): S.CANCELLING, (S.CANCELLING, E.STOPPED): S.CANCELLED,
    (S.CANCELLING, E.COMPLETED): S.CANCELLED, (S.CANCELLING, E.ERROR): S.CANCELLED,
    (S.CANCELLING, E.STARTED): S.CANCELLING, (S.CANCELLING, E.REQUEUED): S.CANCELLING,
    **{(s, E.CANCEL): S.CANCELLING for s in ACTIVE - {S.CANCELLING}},
    **{(s, E.ERROR): S.FAILED for s in ACTIVE - {S.CANCELLING}},
}


@pytest.mark.parametrize(("state", "event"), list(itertools.product(JobState, Event)))
def test_every_pair(state: JobState, event: Event) -> None:
    want = EXPECTED.get((state, event))
    if want is None:
        with pytest.raises(IllegalTransition, match=event.value):
            transition(state, event)
    else:
        assert transition(state, event) is want


def test_table_is_frozen_and_complete() -> None:
    assert dict(TRANSITIONS) == EXPECTED
    with pytest.raises(TypeError):
        TRANSITIONS[(S.QUEUED, E.PUBLISHED)] = S.SUCCEEDED  # type: ignore[index]


def test_terminal_states_accept_nothing() -> None:
    for state, event in itertools.product(TERMINAL, Event):
        with pytest.raises(IllegalTransition):
            transition(state, event)


def test_only_publishing_reaches_succeeded() -> None:
    assert {s for (s, _), t in TRANSITIONS.items() if t is S.SUCCEEDED} == {S.PUBLISHING}


def test_a_cancelled_job_can_never_succeed() -> None:
    reachable, frontier = {S.CANCELLING}, [S.CANCELLING]
    while frontier:
        s = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is s and dst not in reachable:
                reachable.add(dst)
                frontier.append(dst)
    assert reachable == {S.CANCELLING, S.CANCELLED}


@pytest.mark.parametrize(("slurm", "exit_code", "running", "event", "reason"), [
    (None, None, False, None, None),
    ("PENDING", None, False, None, None),
    ("PENDING", None, True, E.REQUEUED, None),
    ("REQUEUED", None, True, E.REQUEUED, None),
    ("CONFIGURING", None, False, None, None),
    ("RUNNING", None, False, E.STARTED, None),
    ("COMPLETING", None, False, E.STARTED, None),
    ("COMPLETED", 0, True, E.COMPLETED, None),
    ("TIMEOUT", 0, True, E.ERROR, FailReason.TIMEOUT),
    ("NODE_FAIL", None, True, E.ERROR, FailReason.NODE_FAIL),
    ("OUT_OF_MEMORY", None, True, E.ERROR, FailReason.OOM),
    ("CANCELLED by 0", None, True, E.STOPPED, FailReason.INTERNAL),
    ("FAILED", 65, True, E.ERROR, FailReason.USER_ERROR),
    ("FAILED", 78, True, E.ERROR, FailReason.USER_ERROR),
    ("FAILED", 1, True, E.ERROR, FailReason.INTERNAL),
    ("SOMETHING_NEW", None, True, None, None),
])
def test_from_slurm(slurm: str | None, exit_code: int | None, running: bool, event: Event | None,
                    reason: FailReason | None) -> None:
    view = from_slurm(slurm, exit_code, was_running=running)
    assert (view.event, view.reason) == (event, reason)
    if reason is not None:
        assert view.message and len(view.message) > 20


def test_openai_names() -> None:
    assert {s.value for s in JobState} - {"cancelling", "publishing"} == {
        "validating_files", "queued", "running", "succeeded", "failed", "cancelled"}
