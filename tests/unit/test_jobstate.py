"""The job state machine and the reconciler's decision over it, exhaustively."""

from __future__ import annotations

import itertools

import pytest

from gateway.state import (
    ACTIVE,
    TERMINAL,
    TRANSITIONS,
    Action,
    Decision,
    Event,
    FailReason,
    IllegalTransition,
    JobState,
    SlurmView,
    decide,
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
    # pause: from queued or running; held until resumed; a job that finished first still publishes
    (S.QUEUED, E.PAUSE): S.PAUSED, (S.RUNNING, E.PAUSE): S.PAUSED, (S.PAUSED, E.PAUSE): S.PAUSED,
    (S.PAUSED, E.STARTED): S.PAUSED, (S.PAUSED, E.REQUEUED): S.PAUSED,
    (S.PAUSED, E.COMPLETED): S.PUBLISHING, (S.PAUSED, E.RESUME): S.QUEUED,
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
    ("FAILED", 69, True, E.ERROR, FailReason.NODE_FAIL),      # a GPU was promised, CUDA not usable
    ("FAILED", 76, True, E.ERROR, FailReason.NODE_FAIL),      # a gang lost ranks past its requeue limit
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
        "validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"}


A = Action
KINDS = [None, *Event]                     # every event a SlurmView can carry, and "nothing changed"
# What the reconciler does, by state and Slurm's event (Slurm still lists a process: gone=False).
# VALIDATING_FILES and the terminal states are never watched; for them COMPLETE and FAIL are what
# the reconciler would attempt and transition() refuses.
DECISIONS = {
    **{(S.CANCELLING, k): A.CANCEL for k in KINDS},
    **{(S.PUBLISHING, k): A.PUBLISH for k in KINDS},
    (S.QUEUED, E.STARTED): A.START,
    (S.RUNNING, E.REQUEUED): A.REQUEUE,
    (S.PAUSED, E.STARTED): A.PAUSE,        # Slurm still runs it: (re)send the hold and the signal
    **{(s, E.COMPLETED): A.COMPLETE for s in set(S) - {S.CANCELLING, S.PUBLISHING}},
    **{(s, k): A.FAIL for s in set(S) - {S.CANCELLING, S.PUBLISHING} for k in (E.ERROR, E.STOPPED)},
}
APPLIES = {A.START: E.STARTED, A.REQUEUE: E.REQUEUED, A.COMPLETE: E.COMPLETED, A.FAIL: E.ERROR,
           A.CANCELLED: E.STOPPED}


def _view(kind: Event | None) -> SlurmView:
    if kind in (E.ERROR, E.STOPPED):
        return SlurmView(kind, FailReason.OOM, "the job ran out of memory")
    return SlurmView(kind)


@pytest.mark.parametrize("gone", [False, True])
@pytest.mark.parametrize(("state", "kind"), list(itertools.product(JobState, KINDS)))
def test_decide_every_state_and_event(state: JobState, kind: Event | None, gone: bool) -> None:
    want = DECISIONS.get((state, kind), A.NOTHING)
    if state is S.CANCELLING and gone:
        want = A.CANCELLED
    got = decide(state, _view(kind), gone=gone)
    if want is A.FAIL:
        assert got == Decision(A.FAIL, FailReason.OOM, "the job ran out of memory")
    else:
        assert got == Decision(want)


@pytest.mark.parametrize("state", [S.QUEUED, S.RUNNING, S.PAUSED, S.PUBLISHING, S.CANCELLING])
@pytest.mark.parametrize("gone", [False, True])
def test_decide_never_picks_an_event_a_watched_state_refuses(state: JobState, gone: bool) -> None:
    for kind in KINDS:
        event = APPLIES.get(decide(state, _view(kind), gone=gone).action)
        if event is not None:
            transition(state, event)


@pytest.mark.parametrize(("view", "trainer", "reason", "message"), [
    (SlurmView(E.ERROR, FailReason.USER_ERROR, "rejected"), "line 3: no messages", FailReason.USER_ERROR,
     "line 3: no messages"),                                  # the trainer's own words win
    (SlurmView(E.ERROR, FailReason.TIMEOUT, "time limit"), None, FailReason.TIMEOUT, "time limit"),
    (SlurmView(E.STOPPED), None, FailReason.INTERNAL, "the job failed"),
    (from_slurm("CANCELLED by 0"), None, FailReason.INTERNAL,
     "the job was cancelled outside the gateway (by an administrator)"),
])
def test_decide_failure_reason_and_message(view: SlurmView, trainer: str | None, reason: FailReason,
                                           message: str) -> None:
    assert decide(S.RUNNING, view, trainer_failure=trainer) == Decision(A.FAIL, reason, message)
