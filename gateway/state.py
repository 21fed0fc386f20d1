"""The one job state machine, and the only place that knows Slurm's state names.

``transition(state, event)`` is the only way a job's state changes (the service
layer calls it inside a version-checked update). ``from_slurm`` turns what Slurm
reports into an event, and ``decide`` turns a job's state and that event into what
the reconciler does next. The OpenAI-visible status is ``state.value``. Pure: this
module imports nothing from the rest of the gateway (only the contract's exit codes).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from trainer.contract import exitcodes


class SweepState(StrEnum):
    """A sweep's status, from its runs': running while any is unfinished, then succeeded (all did) or finished."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FINISHED = "finished"


class DeliveryState(StrEnum):
    """A webhook delivery's status: pending until a 2xx answer (delivered) or out of attempts (failed)."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


class TrackingState(StrEnum):
    """A job's MLflow run as the gateway logs it: logging (until the job ended and every event is logged),
    done (the run completed with the job's status), failed (given up after ``mlflow_max_attempts``)."""

    LOGGING = "logging"
    DONE = "done"
    FAILED = "failed"


class MlflowRunStatus(StrEnum):
    """MLflow's own run status words (its ``RunStatus``), which the gateway sets on a tenant's run."""

    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"


LOCAL_QOS = "local"
"""The QOS a local-mode job reports (``gateway.slurm.local``): no Slurm tier; the CLI says "local job"."""


class JobState(StrEnum):
    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    PUBLISHING = "publishing"
    PAUSED = "paused"                # the tenant paused it: checkpointed, held in Slurm's queue
    SUCCEEDED = "succeeded"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    FAILED = "failed"


class Phase(StrEnum):
    TOKENIZING = "tokenizing"
    TRAINING = "training"
    EVALUATING = "evaluating"


class Event(StrEnum):
    SUBMITTED = "submitted"          # files valid, sbatch accepted
    STARTED = "started"              # Slurm: RUNNING
    REQUEUED = "requeued"            # Slurm: back to PENDING (time limit, node failure, admin)
    COMPLETED = "completed"          # Slurm: COMPLETED (exit 0)
    PUBLISHED = "published"          # artifacts moved into place, in the same transaction
    CANCEL = "cancel"                # tenant asked
    PAUSE = "pause"                  # tenant asked: checkpoint, leave the GPU, stay held
    RESUME = "resume"                # tenant asked: release the hold, continue from the checkpoint
    STOPPED = "stopped"              # Slurm says the job ended (any way) and no process is left
    ERROR = "error"                  # failed, with a FailReason


class Cleanup(StrEnum):
    """A finished job's node cleanup, as the epilog's scrub report tells it."""

    PENDING = "pending"        # the job ended; the epilog has not reported yet
    CONFIRMED = "confirmed"    # the scrub passed
    FAILED = "failed"          # the scrub failed: the node was drained
    OFF = "off"                # local mode: no scrubber runs


class FailReason(StrEnum):
    USER_ERROR = "user_error"
    TIMEOUT = "timeout"
    NODE_FAIL = "node_fail"
    OOM = "oom"
    INTERNAL = "internal"


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.CANCELLED, JobState.FAILED})
ACTIVE = frozenset(JobState) - TERMINAL
MLFLOW_END = MappingProxyType({JobState.SUCCEEDED: MlflowRunStatus.FINISHED, JobState.FAILED: MlflowRunStatus.FAILED,
                               JobState.CANCELLED: MlflowRunStatus.KILLED})
"""The status an ended job's MLflow run is completed with."""


class IllegalTransition(ValueError):
    """``event`` cannot happen in ``state``; nothing was changed."""

    def __init__(self, state: JobState, event: Event):
        super().__init__(f"event {event.value!r} is not allowed in state {state.value!r}")
        self.state, self.event = state, event


def _table() -> dict[tuple[JobState, Event], JobState]:
    S, E = JobState, Event
    t = {
        (S.VALIDATING_FILES, E.SUBMITTED): S.QUEUED,
        (S.QUEUED, E.STARTED): S.RUNNING,
        (S.QUEUED, E.REQUEUED): S.QUEUED,
        (S.QUEUED, E.COMPLETED): S.PUBLISHING,    # ran between two reconcile cycles
        (S.RUNNING, E.STARTED): S.RUNNING,
        (S.RUNNING, E.REQUEUED): S.QUEUED,
        (S.RUNNING, E.COMPLETED): S.PUBLISHING,
        (S.PUBLISHING, E.PUBLISHED): S.SUCCEEDED,
        (S.CANCELLING, E.CANCEL): S.CANCELLING,   # cancel is idempotent
        (S.CANCELLING, E.STOPPED): S.CANCELLED,
        (S.CANCELLING, E.COMPLETED): S.CANCELLED,  # finished anyway: never published
        (S.CANCELLING, E.ERROR): S.CANCELLED,
        (S.CANCELLING, E.STARTED): S.CANCELLING,
        (S.CANCELLING, E.REQUEUED): S.CANCELLING,
        (S.QUEUED, E.PAUSE): S.PAUSED,
        (S.RUNNING, E.PAUSE): S.PAUSED,
        (S.PAUSED, E.PAUSE): S.PAUSED,            # pause is idempotent
        (S.PAUSED, E.STARTED): S.PAUSED,          # still checkpointing after the signal
        (S.PAUSED, E.REQUEUED): S.PAUSED,         # checkpointed and back in the queue, held
        (S.PAUSED, E.COMPLETED): S.PUBLISHING,    # it finished before the pause took effect
        (S.PAUSED, E.RESUME): S.QUEUED,
    }
    for s in ACTIVE - {S.CANCELLING}:
        t[(s, E.CANCEL)] = S.CANCELLING
        t[(s, E.ERROR)] = S.FAILED
    return t


TRANSITIONS = MappingProxyType(_table())


def transition(state: JobState, event: Event) -> JobState:
    """The state after ``event``; raises IllegalTransition (terminal states accept none)."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(state, event) from None


@dataclass(frozen=True)
class SlurmView:
    """What a Slurm state means for a job: an event (or None: nothing changed) and,
    for errors, a reason and a message a tenant can act on."""

    event: Event | None
    reason: FailReason | None = None
    message: str | None = None


# trainer exit codes (trainer/contract/exitcodes.py) → failure reasons
_EXIT_REASONS = {
    exitcodes.USER_ERROR: (FailReason.USER_ERROR, "the dataset or job spec was rejected by the trainer"),
    exitcodes.MODEL_ERROR: (FailReason.USER_ERROR, "the base model is missing or does not match its digest"),
    exitcodes.PEER_LOST: (FailReason.NODE_FAIL, "a rank of the job was lost (a process died or a node failed) "
                                                "more often than the requeue limit allows"),
    exitcodes.GPU_UNAVAILABLE: (FailReason.NODE_FAIL, "the node's GPU is not usable (CUDA unavailable): nothing "
                                                      "was trained; submit the job again"),
    exitcodes.CANCELLED: (FailReason.INTERNAL, "the trainer was stopped by a signal"),
}


class SlurmState(StrEnum):
    """Slurm's job state words (squeue %T, sacct State) that the gateway reasons about."""

    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    RESIZING = "RESIZING"
    REQUEUED = "REQUEUED"
    REQUEUE_FED = "REQUEUE_FED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    BOOT_FAIL = "BOOT_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    DEADLINE = "DEADLINE"
    PREEMPTED = "PREEMPTED"
    REVOKED = "REVOKED"


S = SlurmState
_PENDING = {S.PENDING, S.REQUEUED, S.REQUEUE_HOLD, S.REQUEUE_FED, S.CONFIGURING, S.RESV_DEL_HOLD,
            S.SPECIAL_EXIT, S.SUSPENDED, S.STOPPED, S.RESIZING}
_RUNNING = {S.RUNNING, S.COMPLETING, S.SIGNALING, S.STAGE_OUT}
# States in which a job may still own processes on a node (the cancel and scrub paths wait them out).
SLURM_ACTIVE = frozenset(_PENDING | _RUNNING)


def state_word(state: str) -> str:
    """The state word of a squeue/sacct State field (``CANCELLED by 0`` -> ``CANCELLED``, ``RUNNING+`` ->
    ``RUNNING``); "" for an empty one."""
    return state.split()[0].rstrip("+").upper() if state.strip() else ""


def from_slurm(state: str | None, exit_code: int | None = None, *, was_running: bool = False) -> SlurmView:
    """Map a Slurm job state (squeue %T / sacct State) to an event.

    ``None`` (the job is in neither squeue nor sacct yet) is "not yet visible":
    no event, never a failure. ``was_running`` tells a requeue (PENDING after
    RUNNING) from a job still waiting.
    """
    if state is None:
        return SlurmView(None)
    s = state_word(state)
    if s in _PENDING:
        return SlurmView(Event.REQUEUED if was_running else None)
    if s in _RUNNING:
        return SlurmView(Event.STARTED)
    if s == S.COMPLETED:
        return SlurmView(Event.COMPLETED)
    if s == S.TIMEOUT:
        return SlurmView(Event.ERROR, FailReason.TIMEOUT,
                         "the job reached its time limit (its newest checkpoint is kept): continue it "
                         "with from_checkpoint and more time, or ask for fewer epochs")
    if s in (S.NODE_FAIL, S.BOOT_FAIL):
        return SlurmView(Event.ERROR, FailReason.NODE_FAIL,
                         "the compute node failed; submit the job again")
    if s == S.OUT_OF_MEMORY:
        return SlurmView(Event.ERROR, FailReason.OOM,
                         "the job ran out of memory: lower batch_size_tokens or max_seq_len")
    if s == S.CANCELLED:
        return SlurmView(Event.STOPPED, FailReason.INTERNAL,
                         "the job was cancelled outside the gateway (by an administrator)")
    if s in (S.FAILED, S.DEADLINE, S.PREEMPTED, S.REVOKED):
        reason, msg = _EXIT_REASONS.get(exit_code or -1, (FailReason.INTERNAL,
                                                          f"the job failed (it ended {s}, exit code {exit_code})"))
        return SlurmView(Event.ERROR, reason, msg)
    return SlurmView(None)   # an unknown new Slurm state: change nothing, the next cycle decides


class Action(StrEnum):
    """What the reconciler does for one job in one cycle (``decide``)."""

    NOTHING = "nothing"
    CANCEL = "cancel"              # CANCELLING and Slurm may still run it: (re)start the cancel
    CANCELLED = "cancelled"        # CANCELLING and Slurm shows no process left: apply STOPPED
    PAUSE = "pause"                # PAUSED and Slurm still runs it: (re)send hold + checkpoint signal
    PUBLISH = "publish"            # PUBLISHING: (re)try the publication
    START = "start"                # apply STARTED
    REQUEUE = "requeue"            # apply REQUEUED
    COMPLETE = "complete"          # apply COMPLETED, then publish
    FAIL = "fail"                  # apply ERROR with ``reason`` and ``message``


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: FailReason | None = None
    message: str | None = None


def decide(state: JobState, view: SlurmView, *, gone: bool = False,
           trainer_failure: str | None = None) -> Decision:
    """What to do for a job in ``state`` given what Slurm shows (``view``, from ``from_slurm``).

    A job being cancelled or published keeps doing that whatever the event: a cancel is
    confirmed only when Slurm lists the job with no process left (``gone``). A failure's
    message is the trainer's own (``trainer_failure``, from its events) when it gave one.
    The event applied may still be refused by ``transition`` (IllegalTransition) when the
    state does not allow it.
    """
    if state is JobState.CANCELLING:
        return Decision(Action.CANCELLED if gone else Action.CANCEL)
    if state is JobState.PUBLISHING:
        return Decision(Action.PUBLISH)
    if state is JobState.PAUSED and view.event is Event.STARTED:
        return Decision(Action.PAUSE)
    if state is JobState.PAUSED and view.event is None:
        return Decision(Action.NOTHING)          # held in the queue, as asked
    if view.event is Event.STARTED and state is JobState.QUEUED:
        return Decision(Action.START)
    if view.event is Event.REQUEUED and state is JobState.RUNNING:
        return Decision(Action.REQUEUE)
    if view.event is Event.COMPLETED:
        return Decision(Action.COMPLETE)
    if view.event in (Event.ERROR, Event.STOPPED):
        return Decision(Action.FAIL, view.reason or FailReason.INTERNAL,
                        trainer_failure or view.message or "the job failed")
    return Decision(Action.NOTHING)
