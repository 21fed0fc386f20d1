"""Fine-tuning jobs: creation with admission control, state changes, cancellation.

Every state change goes through ``apply_event``: ``jobs.state.transition`` plus an
UPDATE guarded by the row's ``version``, so two writers (a cancel and a
publication, a reconciler and a request) can never both win.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from gateway.access.tokens import Principal
from gateway.config import Settings
from gateway.errors import Conflict, NotFound, ServiceError, TooManyJobs
from gateway.models import DataFile, FileStatus, FineTuningJob, JobCheckpoint, JobEvent, Tenant, utcnow
from gateway.services.files import get_file
from gateway.state import ACTIVE, TERMINAL, Event, FailReason, JobState, transition
from gateway.storage import layout

if TYPE_CHECKING:
    from trainer.catalog import CatalogEntry
    from trainer.memory import MemoryEstimate, ModelShape

class Submit(Protocol):
    """``submit(job, spec, tenant) -> (scheduler job id, qos)``: ``jobs.submission.Submitter``."""

    def __call__(self, job: FineTuningJob, spec: dict[str, Any], tenant: str) -> tuple[int, str]:
        """Submit ``job`` as ``tenant``; return the scheduler's job id and the QOS tier used."""
        ...

    def qos_for(self, tenant: str, minutes: int, gpus: int = 1) -> str:
        """The QOS tier a job of ``minutes`` on ``gpus`` GPUs would get; ServiceError naming the limit
        when none of the tenant's tiers allows that many GPUs."""
        ...

log = logging.getLogger(__name__)

# OpenAI's hyperparameter names → ours; ours are accepted as they are.
OPENAI_HP = {"n_epochs": "epochs", "learning_rate_multiplier": "learning_rate_multiplier",
             "batch_size": "batch_size"}
BASE_LEARNING_RATE = 2e-4
DEFAULT_EPOCHS = 3
DEFAULT_BETA = 0.1     # DPO's (trainer.spec.Hyperparameters.beta; TRL's and OpenAI's default)
MAX_EPOCHS = 100   # trainer.spec.Hyperparameters.epochs


class StaleJob(Exception):
    """The job row changed under us (version mismatch): re-read and decide again."""


@dataclass(frozen=True)
class JobRequest:
    training_file: str
    model: str
    validation_file: str | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    suffix: str | None = None
    seed: int | None = None
    metadata: dict[str, str] | None = None
    idempotency_key: str | None = None
    gpus: int = 1           # in all: one trainer rank each
    nodes: int = 1
    fsdp: bool = False      # shard the model over the ranks
    from_checkpoint: str | None = None   # "<job id>[:<step>]": continue from that job's checkpoint (Together's way)
    method: str = "supervised"           # or "dpo": preference pairs (METHODS)

    def digest(self) -> str:
        """sha256 of the request without its idempotency key: a reused key must come with the same request."""
        # fields at their defaults that came later are left out: a retry of an older request keeps its digest
        fields = {k: v for k, v in self.__dict__.items()
                  if k != "idempotency_key" and not (k in ("fsdp", "from_checkpoint") and not v)
                  and not (k == "method" and v == "supervised")}
        body = json.dumps(fields,
                          sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()


# ------------------------------------------------------------------ state changes
def apply_event(session: Session, job: FineTuningJob, event: Event, *, message: str | None = None,
                level: str = "info", **changes: Any) -> JobState:
    """Move ``job`` by ``event`` (IllegalTransition if not allowed), with ``changes``,
    in the caller's transaction. Raises StaleJob if another writer got there first."""
    before = JobState(job.status)
    new = transition(before, event)
    update_fields(session, job, status=new.value, **changes)
    add_event(session, job.id, message or f"Job {new.value.replace('_', ' ')}", level=level,
              data={"status": new.value})
    if new in TERMINAL and before not in TERMINAL:
        from gateway.services import webhooks

        webhooks.enqueue(session, job, new)     # the outbox: in this transaction, or not at all
    return new


def update_fields(session: Session, job: FineTuningJob, **changes: Any) -> None:
    """Change ``job``'s row, bumping its version, only if nobody changed it since it was read."""
    values = {"version": job.version + 1, **changes}
    res = session.execute(sa.update(FineTuningJob)
                          .where(col(FineTuningJob.id) == job.id, col(FineTuningJob.version) == job.version)
                          .values(**values))
    if res.rowcount != 1:  # type: ignore[attr-defined]
        raise StaleJob(job.id)
    for k, v in values.items():
        setattr(job, k, v)


def add_event(session: Session, job_id: str, message: str, *, level: str = "info",
              type_: str = "message", data: dict[str, Any] | None = None,
              created_at: datetime | None = None) -> None:
    """Add an event to the job's log in the caller's transaction (message cut to 1000 characters)."""
    session.add(JobEvent(job_id=job_id, message=message[:1000], level=level, type=type_, data=data,
                         created_at=created_at or utcnow()))


# ------------------------------------------------------------------------ reads
INTERNAL_PROGRESS = frozenset({"failure", "node", "counted_step", "window", "seen_at", "checkpoint_at", "fired"})
"""``progress`` keys the job object leaves out: the gateway's bookkeeping (the detectors' watch among it)."""


def tenant_id_of(principal: Principal) -> int:
    """The caller's tenant id; Forbidden for a principal without a tenant (staff, admins)."""
    if principal.tenant_id is None:
        from gateway.errors import Forbidden

        raise Forbidden("this route needs a tenant token (member or tenant admin)")
    return principal.tenant_id


def get_job(*, session: Session, principal: Principal, job_id: str) -> FineTuningJob:
    """The tenant's job; NotFound for a missing or foreign id alike."""
    tid = tenant_id_of(principal)
    # scoped in SQL: a foreign row is never loaded, so "foreign" costs exactly what "missing" does
    job = session.exec(select(FineTuningJob).where(FineTuningJob.id == job_id, FineTuningJob.tenant_id == tid)
                       ).first() if len(job_id) <= 40 else None
    if job is None:
        raise NotFound(f"no such fine-tuning job: {job_id}", param="fine_tuning_job_id")
    return job


def list_jobs(*, session: Session, principal: Principal, after: str | None, limit: int,
              metadata: dict[str, str] | None = None) -> tuple[list[FineTuningJob], bool]:
    """The tenant's jobs, newest first, after the job ``after`` (NotFound when it is not the tenant's);
    (page, has_more). With ``metadata``, only jobs whose metadata has those values."""
    tid = tenant_id_of(principal)
    q = select(FineTuningJob).where(FineTuningJob.tenant_id == tid)
    if after:
        anchor = session.get(FineTuningJob, after)
        if anchor is None or anchor.tenant_id != tid:
            raise NotFound(f"no such fine-tuning job: {after}", param="after")
        q = q.where(sa.or_(col(FineTuningJob.created_at) < anchor.created_at,
                           sa.and_(col(FineTuningJob.created_at) == anchor.created_at,
                                   col(FineTuningJob.id) < anchor.id)))
    q = q.order_by(col(FineTuningJob.created_at).desc(), col(FineTuningJob.id).desc())
    rows = list(session.exec(q.limit(limit + 1 if not metadata else 100_000)))
    if metadata:
        rows = [r for r in rows if all((r.meta or {}).get(k) == v for k, v in metadata.items())]
    return rows[:limit], len(rows) > limit


# ---------------------------------------------------------------- fast reads
# The API's hot reads (retrieve, list, events) take Core rows of just the columns a job or event object
# shows, on the session's connection: no ORM object, identity map or unit of work per row, and no
# decoding of columns nobody returns (``lineage``, the spec's request hash). ``job_object`` and
# ``event_object`` read a row exactly as they read the model (same attribute names, the same column
# types decode them); tests/service/test_read_paths.py holds the bytes equal to the ORM path's.
_J = FineTuningJob.__table__.c  # type: ignore[attr-defined]
JOB_VIEW = (_J.id, _J.tenant_id, _J.model, _J.parent_model, _J.created_at, _J.finished_at, _J.fine_tuned_model,
            _J.result_files, _J.status, _J.validation_file, _J.training_file, _J.hyperparameters, _J.trained_tokens,
            _J.error, _J.suffix, _J.seed, _J.estimated_finish, _J.expected_start, _J.meta, _J.slurm_job_id,
            _J.attempt, _J.phase, _J.qos, _J.gpus, _J.nodes, _J.fsdp, _J.cleanup, _J.stop_confirmed_at, _J.progress,
            _J.method)
_E = JobEvent.__table__.c  # type: ignore[attr-defined]
EVENT_VIEW = (_E.id, _E.created_at, _E.level, _E.message, _E.data, _E.type)


def _own_job_row(session: Session, tid: int, job_id: str, columns: tuple[Any, ...],
                 param: str = "fine_tuning_job_id") -> Any:
    """``columns`` of the tenant's job ``job_id``; NotFound naming ``param`` for a missing or foreign id
    alike (scoped in SQL: a foreign row is never read)."""
    row = session.connection().execute(sa.select(*columns).where(_J.id == job_id, _J.tenant_id == tid)).first() \
        if len(job_id) <= 40 else None
    if row is None:
        raise NotFound(f"no such fine-tuning job: {job_id}", param=param)
    return row


def read_job(*, session: Session, principal: Principal, job_id: str) -> Any:
    """The tenant's job as a row of JOB_VIEW; NotFound for a missing or foreign id alike."""
    return _own_job_row(session, tenant_id_of(principal), job_id, JOB_VIEW)


def read_jobs(*, session: Session, principal: Principal, after: str | None,
              limit: int) -> tuple[list[Any], bool]:
    """``list_jobs`` as JOB_VIEW rows: the tenant's jobs, newest first, after the job ``after`` (NotFound
    when it is not the tenant's); (page, has_more)."""
    tid = tenant_id_of(principal)
    q = sa.select(*JOB_VIEW).where(_J.tenant_id == tid)
    if after:
        anchor = _own_job_row(session, tid, after, (_J.created_at, _J.id), param="after")
        q = q.where(sa.or_(_J.created_at < anchor.created_at,
                           sa.and_(_J.created_at == anchor.created_at, _J.id < anchor.id)))
    rows = list(session.connection().execute(q.order_by(_J.created_at.desc(), _J.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def read_events(*, session: Session, principal: Principal, job_id: str, after: int | None,
                limit: int) -> tuple[list[Any], bool]:
    """``list_events`` as EVENT_VIEW rows, newest first; NotFound unless the job is the tenant's."""
    _own_job_row(session, tenant_id_of(principal), job_id, (_J.id,))
    q = sa.select(*EVENT_VIEW).where(_E.job_id == job_id)
    if after is not None:
        q = q.where(_E.id < after)
    rows = list(session.connection().execute(q.order_by(_E.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def list_events(*, session: Session, principal: Principal, job_id: str, after: int | None,
                limit: int) -> tuple[list[JobEvent], bool]:
    """Newest first, like OpenAI's list_events."""
    get_job(session=session, principal=principal, job_id=job_id)
    q = select(JobEvent).where(JobEvent.job_id == job_id)
    if after is not None:
        q = q.where(col(JobEvent.id) < after)
    rows = list(session.exec(q.order_by(col(JobEvent.id).desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def list_checkpoints(*, session: Session, principal: Principal, job_id: str) -> list[JobCheckpoint]:
    """The job's checkpoints, highest step first; NotFound for a job that is not the tenant's."""
    get_job(session=session, principal=principal, job_id=job_id)
    q = select(JobCheckpoint).where(JobCheckpoint.job_id == job_id)
    return list(session.exec(q.order_by(col(JobCheckpoint.step).desc())))


# ----------------------------------------------------------------------- create
def usable_file(session: Session, principal: Principal, file_id: str, param: str) -> DataFile:
    """The caller's processed file ``file_id`` (NotFound naming ``param``; ServiceError if not processed)."""
    try:
        row = get_file(session=session, principal=principal, file_id=file_id)
    except NotFound as e:
        raise NotFound(f"no such file: {file_id}", param=param) from e
    if row.status != FileStatus.PROCESSED:
        raise ServiceError(f"file {file_id} has status {row.status!r}: only validated files "
                           f"(status 'processed') can be used for training ({row.status_details or ''})",
                           param=param, code="invalid_file")
    return row


METHODS = {"supervised": "chat", "dpo": "preference"}
"""Each training method and the dataset format it trains on (the upload validator's ``stats.format``)."""


def _file_format(row: DataFile) -> str:
    """File ``row``'s format as its validation found it (a file validated before formats existed is chat)."""
    return str(((row.validation or {}).get("stats") or {}).get("format") or "chat")


def method_for(row: DataFile) -> str:
    """The method that trains on file ``row``'s format."""
    have = _file_format(row)
    return next(method for method, fmt in METHODS.items() if fmt == have)


def _fits_method(row: DataFile, method: str, param: str) -> None:
    """ServiceError (400, ``invalid_file``) unless file ``row`` holds the format ``method`` trains on."""
    have, want = _file_format(row), METHODS[method]
    if have != want:
        what = {"chat": "chat conversations ({\"messages\": [...]})",
                "preference": "preference pairs ({\"input\", \"preferred_output\", \"non_preferred_output\"})"}
        raise ServiceError(f"{param} {row.id} holds {what[have]}, but a {method} job trains on {what[want]}",
                           param=param, code="invalid_file")


def _epochs(hp: dict[str, Any]) -> int:
    """The number of epochs the estimate needs; ServiceError (400) naming the field when it
    is not a whole number in the trainer's range (the full spec is checked later)."""
    value = hp.get("epochs", DEFAULT_EPOCHS)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value != int(value) or not 1 <= value <= MAX_EPOCHS:
        raise ServiceError(f"hyperparameters.n_epochs must be a whole number from 1 to {MAX_EPOCHS}",
                           param="hyperparameters.n_epochs")
    return int(value)


def build_hyperparameters(raw: dict[str, Any]) -> dict[str, Any]:
    """OpenAI-style (n_epochs, learning_rate_multiplier, batch_size) or native names → ours."""
    hp = {k: v for k, v in raw.items() if v != "auto"}
    if "n_epochs" in hp:
        hp["epochs"] = hp.pop("n_epochs")
    if "learning_rate_multiplier" in hp:
        mult = hp.pop("learning_rate_multiplier")
        if not isinstance(mult, int | float) or isinstance(mult, bool) or mult <= 0:
            raise ServiceError("learning_rate_multiplier must be a positive number",
                               param="hyperparameters.learning_rate_multiplier")
        hp["learning_rate"] = BASE_LEARNING_RATE * mult
    hp.pop("batch_size", None)  # examples per batch: we pack by tokens (batch_size_tokens)
    return hp


def check_resources(settings: Settings, gpus: int, nodes: int, fsdp: bool = False) -> None:
    """ServiceError (400, naming the field) unless ``gpus`` over ``nodes`` is a gang this site runs:
    whole GPUs per node (``gpus % nodes == 0``), at most ``max_gpus_per_node`` per node and
    ``max_nodes_per_job`` nodes; local mode runs one process (no gang, no ``fsdp``)."""
    if nodes < 1 or gpus < 1:
        raise ServiceError("resources.gpus and resources.nodes must be at least 1", param="resources")
    if gpus % nodes:
        raise ServiceError(f"resources.gpus ({gpus}) must be a multiple of resources.nodes ({nodes}): "
                           "every node runs the same number of ranks", param="resources.gpus")
    if nodes > settings.max_nodes_per_job:
        raise ServiceError(f"resources.nodes ({nodes}) is over this site's limit of {settings.max_nodes_per_job} "
                           "nodes per job", param="resources.nodes")
    if gpus // nodes > settings.max_gpus_per_node:
        raise ServiceError(f"resources: {gpus // nodes} GPUs per node is over this site's "
                           f"{settings.max_gpus_per_node} per node: spread them over more nodes",
                           param="resources.gpus")
    if settings.local and gpus > 1:
        raise ServiceError("local mode runs one trainer process: resources.gpus must be 1", param="resources.gpus")
    if settings.local and fsdp:
        raise ServiceError("local mode runs one trainer process: resources.fsdp needs a Slurm gang",
                           param="resources.fsdp")


def catalog_entry(settings: Settings, name: str) -> CatalogEntry:
    """The base model ``name`` of the site's catalog; ServiceError (``model_not_found``) naming the others."""
    return _catalog_entry(settings, name)


def _catalog_entry(settings: Settings, name: str) -> CatalogEntry:
    from trainer import catalog

    entries = catalog.list_models(settings.models_root)
    for e in entries:
        if e.name == name:
            return e
    names = ", ".join(sorted({e.name for e in entries})) or "none registered"
    raise ServiceError(f"unknown base model {name!r}; available: {names}", param="model",
                       code="model_not_found")


def estimate(settings: Settings, train: DataFile, epochs: int, gpus: int = 1) -> tuple[int, int]:
    """(training tokens, time limit in minutes) for --time: backfill can place small jobs.

    ``gpus`` ranks share the tokens (data parallel); the estimate counts them at
    ``settings.parallel_efficiency`` each beyond the first, never faster than that."""
    stats = (train.validation or {}).get("stats") or {}
    tokens = (stats.get("tokens") or {}).get("total") or max(1, train.bytes // 4)
    training_tokens = int(tokens) * epochs
    speedup = 1 + (gpus - 1) * settings.parallel_efficiency
    seconds = training_tokens / (settings.throughput_tokens_per_s * speedup) + settings.job_overhead_s
    return training_tokens, max(5, math.ceil(1.5 * seconds / 60))


@dataclass(frozen=True)
class MemoryCheck:
    """A job's estimated per-rank peak (``trainer.memory``) against what one of its ranks has: the
    partition's GPU memory (``Settings.gpu_memory_gib``), or on a CPU partition the job's memory
    limit per rank (``job_mem_mb``); ``limit`` None: not known (a CUDA site that lists no GPU memory)."""

    estimate: MemoryEstimate
    limit: int | None
    partition: str

    @property
    def fits(self) -> bool | None:
        """Whether the estimate is within the limit (None: no limit known)."""
        return None if self.limit is None else self.estimate.total <= self.limit

    def refusal(self) -> str:
        """What create says when it does not fit: the figures and what would make it fit."""
        from trainer.memory import GIB

        est = self.estimate
        need, have = est.total / GIB, (self.limit or 0) / GIB
        where = (f"partition {self.partition}'s GPUs have {have:.1f} GiB" if est.device == "cuda"
                 else f"partition {self.partition} trains on the CPU and a rank's memory limit is {have:.1f} GiB")
        return (f"this job needs ~{need:.1f} GiB per {'GPU' if est.device == 'cuda' else 'rank'} (estimate: "
                f"weights {est.weights / GIB:.1f}, activations {est.activations / GIB:.1f}, logits "
                f"{est.logits / GIB:.1f} GiB), {where}: lower hyperparameters.max_seq_len, "
                "or shard the model over more GPUs (resources.fsdp)")

    def as_dict(self) -> dict[str, Any]:
        """The estimate's ``memory`` object: per-rank figure, limit, fits, and the breakdown in GiB."""
        from trainer.memory import GIB

        return {"per_gpu_gib": self.estimate.gib(), "limit_gib": round(self.limit / GIB, 2) if self.limit else None,
                "fits": self.fits, "partition": self.partition, "device": self.estimate.device,
                "breakdown": self.estimate.as_dict()}


def memory_limit(settings: Settings) -> tuple[str, str, int | None]:
    """``(partition, device, bytes a rank has)`` for the partition jobs go to: its GPUs' memory when
    ``gpu_memory_gib`` lists it (or ``job_device`` is "cuda": unknown, None), else the CPU and
    ``job_mem_mb`` (the dev cluster: its GPUs are gres entries, and the trainer falls back to the CPU)."""
    partition = settings.slurm_partition or "default"
    gib = settings.gpu_memory_gib.get(partition)
    if settings.job_device != "cpu" and gib is not None:
        return partition, "cuda", int(gib * (1 << 30))
    if settings.job_device == "cuda":
        return partition, "cuda", None
    return partition, "cpu", settings.job_mem_mb * (1 << 20)


def memory_check(settings: Settings, spec: dict[str, Any], shape: ModelShape) -> MemoryCheck:
    """The :class:`MemoryCheck` of a validated ``spec`` on a model of ``shape``."""
    from trainer.contract.spec import parse_spec
    from trainer.memory import estimate_job

    job = parse_spec(spec)
    partition, device, limit = memory_limit(settings)
    est = estimate_job(shape, job.hyperparameters, method=job.method, world_size=job.world_size, fsdp=job.fsdp,
                       device="cuda" if device == "cuda" else "cpu")
    return MemoryCheck(est, limit, partition)


def _model_shape(settings: Settings, entry: CatalogEntry) -> ModelShape | None:
    """The catalog model's shape from its config.json; None (no memory check) for one it cannot read."""
    from trainer.catalog import model_dir
    from trainer.memory import read_shape

    try:
        return read_shape(model_dir(settings.models_root, entry.name, entry.digest))
    except ValueError as e:
        log.warning("no memory estimate for model %s: %s", entry.name, e)
        return None


RANK_ROWS = ("batch_size_tokens", "max_seq_len")


def widen_for_ranks(hp: dict[str, Any], method: str, gpus: int) -> str | None:
    """Keep every rank busy: a step's rows are dealt out ``rows[rank::gpus]``, and a full step packs
    into at least ``ceil(batch_size_tokens / row)`` rows (``row``: ``max_seq_len``, DPO
    ``2 * max_seq_len``), so fewer than ``gpus`` of them leaves ranks idle every step.

    When ``batch_size_tokens`` is the default, it is widened in ``hp`` to ``gpus x row`` and the
    returned note says so: recorded with the job, so its spec, its checkpoints and any resume (on
    however many ranks) see the same steps. When the request set it, ServiceError (400) with the
    figure: an explicit budget is the user's, not ours to change. None: nothing to do (or values
    the spec check refuses later)."""
    from trainer.contract.spec import Hyperparameters

    defaults = Hyperparameters()
    seq = hp.get("max_seq_len", defaults.max_seq_len)
    budget = hp.get("batch_size_tokens", defaults.batch_size_tokens)
    if gpus <= 1 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (seq, budget)):
        return None
    row = 2 * seq if method == "dpo" else seq
    rows = -(-budget // row)        # a full step packs into at least this many rows
    if rows >= gpus:
        return None
    need = gpus * row
    if "batch_size_tokens" in hp:
        raise ServiceError(
            f"hyperparameters.batch_size_tokens ({budget}) gives each step at most {rows} row(s) of "
            f"{row} tokens, fewer than the {gpus} GPUs: {gpus - rows} rank(s) would idle every step; set "
            f"batch_size_tokens to at least {need}, lower max_seq_len, or ask for fewer GPUs",
            param="hyperparameters.batch_size_tokens", code="idle_ranks")
    hp["batch_size_tokens"] = need
    return (f"batch_size_tokens widened from the default {budget} to {need} so that each of the {gpus} "
            f"ranks has a row of {row} tokens every step")


def create_job(*, session: Session, settings: Settings, principal: Principal, req: JobRequest,
               submit: Submit) -> FineTuningJob:
    """Validate, admit, record and submit a job. ``submit(job, spec, tenant) -> (id, qos)`` runs sbatch.

    The same Idempotency-Key with the same body returns the same job; with another
    body it is a 409. The row is committed before sbatch, so a crash loses nothing
    (the reconciler adopts or resubmits it).
    """
    tid = tenant_id_of(principal)
    if req.idempotency_key:
        existing = session.exec(select(FineTuningJob).where(
            FineTuningJob.tenant_id == tid, FineTuningJob.idempotency_key == req.idempotency_key)).first()
        if existing is not None:
            return _same_request(existing, req)
    job, spec = prepare_job(session=session, settings=settings, principal=principal, req=req, submit=submit)
    try:
        with session.begin_nested():      # the write lock only from here (SQLite): checks and sacctmgr ran before
            session.add(job)
            session.flush()
    except IntegrityError:
        existing = session.exec(select(FineTuningJob).where(
            FineTuningJob.tenant_id == tid, FineTuningJob.idempotency_key == req.idempotency_key)).first()
        if existing is None:
            raise
        return _same_request(existing, req)
    add_event(session, job.id, f"Created fine-tuning job: {job.id}")
    if (note := _widened(req, job)) is not None:
        add_event(session, job.id, note, level="warning")
    session.commit()
    assert principal.tenant_name is not None
    submit_job(session=session, job=job, spec=spec, tenant=principal.tenant_name, submit=submit)
    return job


def _widened(req: JobRequest, job: FineTuningJob) -> str | None:
    """The note of :func:`widen_for_ranks` when it widened ``job``'s steps (for its event log)."""
    hp = build_hyperparameters(req.hyperparameters)
    return widen_for_ranks(hp, req.method, req.gpus) if "batch_size_tokens" not in hp and \
        "batch_size_tokens" in (job.hyperparameters or {}) else None


def prepare_job(*, session: Session, settings: Settings, principal: Principal, req: JobRequest,
                submit: Submit, sweep_id: str | None = None, pending: int = 0,
                check_memory: bool = True) -> tuple[FineTuningJob, dict[str, Any]]:
    """Validate and admit ``req``: its row (not added to the session: the caller adds it, so that
    no write, and in SQLite no write lock, happens during the checks) and its spec. ``pending``:
    jobs of the same request (a sweep's) not in the database yet, counted against the tenant's
    limit of unfinished jobs. ``check_memory``: refuse (400, ``insufficient_memory``) a job whose
    estimated per-rank peak is over what its ranks have (:func:`memory_check`; the estimate route
    reports it instead)."""
    tid = tenant_id_of(principal)
    tenant_name = principal.tenant_name
    assert tenant_name is not None          # _tenant_id refused a principal without a tenant
    train = usable_file(session, principal, req.training_file, "training_file")
    val = usable_file(session, principal, req.validation_file, "validation_file") \
        if req.validation_file else None
    for row, param in ((train, "training_file"), (val, "validation_file")):
        if row is not None:
            _fits_method(row, req.method, param)
    hp = build_hyperparameters(req.hyperparameters)
    model = _checkpoint_model(session, principal, req) if req.from_checkpoint else req.model
    parent, init = _parent(session, principal, model, hp) if model.startswith("ft:") else (None, None)
    base = parent.model if parent is not None else model
    entry = _catalog_entry(settings, base)
    if parent is not None and parent.model_digest and entry.digest != parent.model_digest:
        raise ServiceError(f"the base model {base} changed since {model} was trained (digest "
                           f"{parent.model_digest}, now {entry.digest}): its adapter does not fit the new base",
                           param="model", code="model_changed")
    if req.seed is not None:
        hp["seed"] = req.seed
    epochs = _epochs(hp)
    check_resources(settings, req.gpus, req.nodes, req.fsdp)
    tokens, minutes = estimate(settings, train, epochs, req.gpus)
    _admit(session, settings, tid, tokens, minutes, pending)
    _gpus_allowed(submit, tenant_name, minutes, req.gpus)
    widen_for_ranks(hp, req.method, req.gpus)
    job = FineTuningJob(tenant_id=tid, training_file=train.id, validation_file=val.id if val else None,
                        model=base, model_digest=entry.digest, hyperparameters=hp,
                        parent_model=model if parent is not None else None,
                        init_file=init.id if init is not None else None, sweep_id=sweep_id,
                        suffix=req.suffix, seed=req.seed, meta=req.metadata,
                        idempotency_key=req.idempotency_key, request_hash=req.digest(),
                        estimated_tokens=tokens, time_limit_min=minutes, gpus=req.gpus, nodes=req.nodes,
                        fsdp=req.fsdp, method=req.method)
    spec = job_spec(settings, tenant_name, job, train, val, entry, init)  # validates hp before any row exists
    shape = _model_shape(settings, entry) if check_memory else None
    if shape is not None and (check := memory_check(settings, spec, shape)).fits is False:
        raise ServiceError(check.refusal(), param="hyperparameters", code="insufficient_memory")
    return job, spec


def estimate_job(*, session: Session, settings: Settings, principal: Principal, req: JobRequest,
                 submit: Submit) -> dict[str, Any]:
    """A dry run of ``create_job``: the same checks and admission (the same errors), nothing written
    or submitted; returns what the job would take and when it would start (``Submitter.expected_start``)."""
    job, spec = prepare_job(session=session, settings=settings, principal=principal, req=req, submit=submit,
                            check_memory=False)
    minutes = job.time_limit_min or 60
    out: dict[str, Any] = {"object": "fine_tuning.job.estimate", "model": job.model,
                           "estimated_tokens": job.estimated_tokens, "gpus": job.gpus, "nodes": job.nodes,
                           "time_limit_minutes": minutes, "expected_minutes": max(1, round(minutes / 1.5)),
                           "gpu_hours": round(job.gpus * minutes / 1.5 / 60, 3),
                           "batch_size_tokens": (job.hyperparameters or {}).get("batch_size_tokens"),
                           "warnings": [note] if (note := _widened(req, job)) else []}
    shape = _model_shape(settings, _catalog_entry(settings, job.model))
    if shape is not None:
        check = memory_check(settings, spec, shape)
        out["memory"] = check.as_dict()
        if check.fits is False:
            out["warnings"].append(check.refusal())
    starts = getattr(submit, "expected_start", None)
    if starts is not None:
        assert principal.tenant_name is not None
        est = starts(job, spec, principal.tenant_name)
        out.update(qos=est.qos, expected_start=int(est.start.timestamp()) if est.start else None,
                   start_reason=est.reason, start_detail=est.why, nodes_planned=est.nodes)
    return out


LORA_SHAPE = ("lora_r", "lora_alpha", "target_modules")
"""Hyperparameters a continued job takes from its parent: the adapter's shape and scale."""


CHECKPOINT_MODEL = re.compile(r"^(ft:.+):ckpt-step-([1-9][0-9]{0,8})$")
"""A checkpoint's model name (OpenAI's ``fine_tuned_model_checkpoint``): the job's model, ``:ckpt-step-<n>``."""


def checkpoint_model_name(job: FineTuningJob, step: int) -> str:
    """The name of ``job``'s checkpoint ``step`` as a model (``<fine-tuned model>:ckpt-step-<n>``)."""
    return f"{job.fine_tuned_model or 'ft:' + job.model}:ckpt-step-{step}"


def checkpoint_files(session: Session, job: FineTuningJob) -> dict[int, DataFile]:
    """The adapter file of each of ``job``'s published checkpoints, by step (deleted ones left out)."""
    rows = session.exec(select(DataFile).where(DataFile.job_id == job.id, DataFile.tenant_id == job.tenant_id,
                                               col(DataFile.deleted_at).is_(None),
                                               col(DataFile.filename).startswith(f"{job.id}-checkpoint-step-")))
    return {step: f for f in rows if (step := layout.checkpoint_step_of(f.filename[len(job.id) + 1:])) is not None}


def find_checkpoint_model(*, session: Session, principal: Principal, model_id: str
                          ) -> tuple[FineTuningJob, int, DataFile]:
    """The tenant's published checkpoint ``model_id`` (``ft:…:ckpt-step-<n>``): its job, step and
    adapter file; NotFound otherwise (a foreign one included)."""
    tid = tenant_id_of(principal)
    m = CHECKPOINT_MODEL.fullmatch(model_id)
    job = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tid,
                                                   FineTuningJob.fine_tuned_model == m.group(1))).first() if m else None
    published = checkpoint_files(session, job).get(int(m.group(2))) if m and job is not None else None
    if job is None or published is None or job.status != JobState.SUCCEEDED:
        raise NotFound(f"no such model: {model_id}", param="model")
    return job, int(m.group(2)) if m else 0, published


JOB_ONLY_LINEAGE = frozenset({"eval", "results", "checkpoints"})   # what a checkpoint's record does not inherit


def checkpoint_lineage(job: FineTuningJob, step: int, adapter: DataFile) -> dict[str, Any]:
    """The registry record of ``job``'s checkpoint ``step``: the job's record for what it was
    trained from and how, the checkpoint's own step, adapter sha256 and the eval at that step."""
    record = {k: v for k, v in (job.lineage or {}).items() if k not in JOB_ONLY_LINEAGE}
    evals = (job.progress or {}).get("evals") or []
    at = [e.get("loss") for e in evals if isinstance(e, dict) and e.get("step") == step
          and isinstance(e.get("loss"), int | float)]
    return {**record, "parent": job.fine_tuned_model,
            "checkpoint": {"step": step, "adapter_file": adapter.id, "sha256": f"sha256:{adapter.sha256}",
                           "eval_loss": at[-1] if at else None}}


def _checkpoint_model(session: Session, principal: Principal, req: JobRequest) -> str:
    """``from_checkpoint`` ("<job id>[:<step>]", the newest published checkpoint without a step) as the
    checkpoint's model name. ``model`` must name the same lineage: the job's base, its model or that
    checkpoint. NotFound (404) for a job or step that is not the tenant's published checkpoint."""
    assert req.from_checkpoint is not None
    job_id, _, raw_step = req.from_checkpoint.partition(":")
    try:
        job = get_job(session=session, principal=principal, job_id=job_id)
    except NotFound:
        raise NotFound(f"no such job: {job_id}", param="from_checkpoint") from None
    files = checkpoint_files(session, job) if job.status == JobState.SUCCEEDED else {}
    step = int(raw_step) if raw_step.isdigit() else max(files, default=0)
    if step not in files:
        raise NotFound(f"job {job_id} has no published checkpoint{f' at step {raw_step}' if raw_step else ''}: "
                       f"a job's checkpoints become models when it succeeds (those it still kept)",
                       param="from_checkpoint")
    name = checkpoint_model_name(job, step)
    if req.model not in (job.model, job.fine_tuned_model, name):
        raise ServiceError(f"model {req.model!r} is not the lineage of {req.from_checkpoint}: give {job.model!r} "
                           f"or {name!r}", param="model")
    return name


def _parent(session: Session, principal: Principal, model_id: str, hp: dict[str, Any]
            ) -> tuple[FineTuningJob, DataFile]:
    """The tenant's own published model ``model_id`` (a job's or one of its checkpoints') and its
    adapter tar, for continued training.

    Fills ``hp`` with the parent's LoRA shape (``LORA_SHAPE``) where the request leaves it out.
    Raises NotFound (404) for a model the tenant does not own (a foreign one included),
    ServiceError (400) when its adapter file is gone or the request asks for another LoRA shape."""
    from trainer.contract.spec import Hyperparameters

    tid = tenant_id_of(principal)
    if CHECKPOINT_MODEL.fullmatch(model_id):
        parent, _, published = find_checkpoint_model(session=session, principal=principal, model_id=model_id)
        adapters = [published]
    else:
        found = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tid,
                                                         FineTuningJob.fine_tuned_model == model_id)).first()
        if found is None or found.status != JobState.SUCCEEDED:
            raise NotFound(f"no such model: {model_id}", param="model")
        parent = found
        adapters = [f for f in (session.get(DataFile, i) for i in parent.result_files or [])
                    if f is not None and f.deleted_at is None and f.filename == f"{parent.id}-adapter.tar"]
    if not adapters:
        raise ServiceError(f"{model_id}'s adapter file is deleted: it cannot be trained further",
                           param="model", code="invalid_model")
    inherited = Hyperparameters.model_validate(
        {k: v for k, v in (parent.hyperparameters or {}).items() if k in LORA_SHAPE}).model_dump(mode="json")
    for key in LORA_SHAPE:
        try:
            asked = Hyperparameters.model_validate({key: hp[key]}).model_dump(mode="json")[key] if key in hp \
                else inherited[key]
        except ValueError:   # pydantic's ValidationError: not a value of that field at all
            raise ServiceError(f"hyperparameters.{key}: {hp[key]!r} is not a valid value",
                               param=f"hyperparameters.{key}") from None
        if asked != inherited[key]:
            raise ServiceError(f"hyperparameters.{key} must be the parent's ({inherited[key]!r}) to continue "
                               f"training {model_id}: the adapter keeps its shape", param=f"hyperparameters.{key}")
        hp[key] = inherited[key]
    return parent, adapters[0]


def _gpus_allowed(submit: Submit, tenant: str, minutes: int, gpus: int) -> None:
    """Refuse (400, naming the limit) a job whose GPUs no QOS tier of the tenant allows, before a row
    exists; when the tiers cannot be read now (Slurm down), submission records that instead."""
    from gateway.errors import SlurmError

    try:
        submit.qos_for(tenant, minutes, gpus)
    except SlurmError:
        log.warning("QOS tiers of %s unreadable at admission; submission will decide", tenant)


def _same_request(existing: FineTuningJob, req: JobRequest) -> FineTuningJob:
    if existing.request_hash != req.digest():
        raise Conflict("this Idempotency-Key was already used with a different request",
                       code="idempotency_key_reused")
    return existing


def _admit(session: Session, settings: Settings, tid: int, tokens: int, minutes: int, pending: int = 0) -> None:
    active = pending + session.exec(select(sa.func.count()).select_from(FineTuningJob).where(
        FineTuningJob.tenant_id == tid, col(FineTuningJob.status).in_([s.value for s in ACTIVE]))).one()
    if active >= settings.max_active_jobs_per_tenant:
        raise TooManyJobs(f"your tenant already has {active} unfinished jobs; the limit is "
                          f"{settings.max_active_jobs_per_tenant}: wait for some to finish")
    if tokens > settings.max_tokens_per_job:
        raise ServiceError(f"the job would train on ~{tokens} tokens; the limit is "
                           f"{settings.max_tokens_per_job}: use fewer epochs or a smaller file",
                           code="limit_exceeded")
    if minutes > settings.max_wall_min:
        raise ServiceError(f"the job needs an estimated {minutes} minutes; the limit is "
                           f"{settings.max_wall_min}: use fewer epochs or a smaller file",
                           code="limit_exceeded")


def job_dir(settings: Settings, tenant: str, job_id: str) -> str:
    """The job dir's absolute path, as the trainer (running as the tenant) sees it."""
    return layout.absolute(settings.storage_root, tenant, layout.job(job_id))


def job_spec(settings: Settings, tenant: str, job: FineTuningJob, train: DataFile,
             val: DataFile | None, entry: CatalogEntry, init: DataFile | None = None) -> dict[str, Any]:
    """The trainer's spec for ``job`` of ``tenant`` (plain values: creation and recovery build
    it the same way); ``init``: the parent's adapter tar (continued training). ServiceError
    naming the field if it is invalid."""
    from gateway.services.files import file_parts
    from trainer.contract.errors import SpecError
    from trainer.contract.spec import parse_spec

    hp = dict(job.hyperparameters or {})
    top = {k: hp.pop(k) for k in ("checkpoint_every_steps", "keep_checkpoints") if k in hp}
    spec: dict[str, Any] = {
        "job_id": job.id,
        "base_model": {"name": job.model, "digest": entry.digest, "catalog_root": str(settings.models_root)},
        "train": {"path": layout.absolute(settings.storage_root, tenant, file_parts(train)),
                  "sha256": train.sha256},
        "validation": ({"path": layout.absolute(settings.storage_root, tenant, file_parts(val)),
                        "sha256": val.sha256} if val else None),
        "hyperparameters": hp,
        "job_dir": job_dir(settings, tenant, job.id),
        "checkpoint_every_steps": top.get("checkpoint_every_steps", settings.checkpoint_every_steps),
        **({"keep_checkpoints": top["keep_checkpoints"]} if "keep_checkpoints" in top else {}),
        **({"device": settings.job_device} if settings.job_device != "auto" else {}),
        **({"world_size": job.gpus} if job.gpus > 1 else {}),
        **({"fsdp": True} if job.fsdp else {}),
        **({"init_adapter": {"path": layout.absolute(settings.storage_root, tenant, file_parts(init)),
                             "sha256": init.sha256}} if init is not None else {}),
        **({"method": job.method} if job.method != "supervised" else {}),
        **({"fault_lr_blowup_at_step": settings.fault_lr_blowup_at_step} if settings.fault_lr_blowup_at_step else {}),
    }
    try:
        parse_spec(spec)
    except SpecError as e:
        raise ServiceError(f"invalid hyperparameters: {e}", param="hyperparameters") from e
    return spec


def saved_spec_matches(saved: bytes | None, expected: dict[str, Any]) -> bool:
    """Whether a spec.json read back from tenant storage (untrusted: the tenant can rewrite it) is
    exactly the spec the gateway would write now: parsed and validated, then compared."""
    from trainer.contract.errors import SpecError
    from trainer.contract.spec import parse_spec

    if saved is None or len(saved) > 1 << 20:
        return False
    try:
        spec = json.loads(saved)
        if not isinstance(spec, dict):
            return False
        parse_spec(spec)
    except (ValueError, SpecError, TypeError):
        return False
    return bool(spec == expected and spec.get("job_dir") == expected["job_dir"])


def submit_job(*, session: Session, job: FineTuningJob, spec: dict[str, Any], tenant: str,
               submit: Submit) -> None:
    """Run sbatch through ``submit`` and record the outcome (QUEUED, or FAILED with Slurm's words)."""
    from gateway.errors import SlurmError

    try:
        slurm_id, qos = submit(job, spec, tenant)
    except SlurmError as e:
        msg = getattr(e, "message", str(e))
        hint = getattr(e, "hint", "")
        apply_event(session, job, Event.ERROR, level="error",
                    message=f"Submission to Slurm failed: {msg}",
                    error={"code": "submission_failed", "message": f"{msg}{' (' + hint + ')' if hint else ''}",
                           "param": None, "reason": FailReason.INTERNAL.value},
                    finished_at=utcnow())
        session.commit()
        return
    apply_event(session, job, Event.SUBMITTED, message=f"Job queued as Slurm job {slurm_id} (QOS {qos})",
                slurm_job_id=slurm_id, qos=qos)
    session.commit()


# ----------------------------------------------------------------------- cancel
def _retrying(session: Session, principal: Principal, job_id: str,
              change: Callable[[FineTuningJob], bool]) -> FineTuningJob:
    """Read the caller's job and apply ``change`` to it (True: it wrote, committed now); read and
    try again when another writer changed the row first (StaleJob). Conflict (``busy``) after 5."""
    for _ in range(5):
        job = get_job(session=session, principal=principal, job_id=job_id)
        try:
            if change(job):
                session.commit()
            return job
        except StaleJob:
            session.rollback()
            session.expire_all()
    raise Conflict(f"job {job_id} is changing state; retry", code="busy")


def request_cancel(*, session: Session, principal: Principal, job_id: str) -> FineTuningJob:
    """Mark the job cancelling at once (idempotent). Conflict (409) if it already finished."""
    def cancel(job: FineTuningJob) -> bool:
        state = JobState(job.status)
        if state is JobState.CANCELLING:
            return False
        if state not in ACTIVE:
            raise Conflict(f"job {job_id} already {state.value}: nothing to cancel", code="job_finished")
        apply_event(session, job, Event.CANCEL, message="Cancellation requested", cancel_requested_at=utcnow())
        if job.slurm_job_id is None:   # never reached Slurm: nothing to stop
            apply_event(session, job, Event.STOPPED, message="Job cancelled (it never reached Slurm)",
                        stop_confirmed_at=utcnow(), finished_at=utcnow())
        return True

    return _retrying(session, principal, job_id, cancel)


def _tenant_name(session: Session, job: FineTuningJob) -> str:
    """The name of ``job``'s tenant (whose Slurm account and user its Slurm job must have)."""
    tenant = session.get(Tenant, job.tenant_id)
    assert tenant is not None
    return tenant.name


class CancelStarter(Protocol):
    """What tells Slurm to stop a job (the reconciler: ``scancel`` in its own thread)."""

    def start_cancel(self, slurm_id: int | None, tenant: str) -> None:
        """Tell Slurm to stop ``tenant``'s job ``slurm_id`` without waiting (nothing when it is None)."""
        ...


def cancel_job(*, session: Session, principal: Principal, job_id: str,
               reconciler: CancelStarter | None) -> FineTuningJob:
    """``request_cancel`` (committed), then, while the job is cancelling and a reconciler runs,
    Slurm is told now; the job turns ``cancelled`` once Slurm confirms the stop. Raises as
    ``request_cancel`` does (NotFound, Conflict)."""
    job = request_cancel(session=session, principal=principal, job_id=job_id)
    if reconciler is not None and job.status == JobState.CANCELLING.value:
        reconciler.start_cancel(job.slurm_job_id, _tenant_name(session, job))
    return job


class PauseControl(Protocol):
    """What holds and releases a job in Slurm (the reconciler: ``scontrol hold``/``release``)."""

    def start_pause(self, slurm_id: int | None, tenant: str) -> None:
        """Hold ``tenant``'s job and make it checkpoint and leave its GPU, without waiting."""
        ...

    def release(self, slurm_id: int | None, tenant: str) -> None:
        """Release ``tenant``'s job's hold (SlurmError when Slurm refuses or it is not the tenant's)."""
        ...


def _change(session: Session, principal: Principal, job_id: str, event: Event, allowed: set[JobState],
            message: str) -> FineTuningJob:
    """Apply ``event`` to the caller's job if it is in one of ``allowed`` (Conflict otherwise), committed."""
    def change(job: FineTuningJob) -> bool:
        state = JobState(job.status)
        if state not in allowed:
            names = " or ".join(sorted(s.value for s in allowed))
            raise Conflict(f"job {job_id} is {state.value}: only a {names} job can {event.value}",
                           code="invalid_state")
        apply_event(session, job, event, message=message)
        return True

    return _retrying(session, principal, job_id, change)


def pause_job(*, session: Session, settings: Settings, principal: Principal, job_id: str,
              control: PauseControl | None) -> FineTuningJob:
    """Pause a queued or running job (idempotent): ``paused`` at once; Slurm holds it, the trainer
    checkpoints after its current step and leaves the GPU. Conflict (409) in any other state or
    without Slurm (local mode)."""
    get_job(session=session, principal=principal, job_id=job_id)     # a foreign id: 404 in any mode
    if control is None or settings.local:
        raise Conflict("pausing needs Slurm: this gateway runs jobs in local mode", code="not_supported")
    job = _change(session, principal, job_id, Event.PAUSE, {JobState.QUEUED, JobState.RUNNING, JobState.PAUSED},
                  "Pause requested: the job checkpoints and leaves its GPU; resume continues from there")
    control.start_pause(job.slurm_job_id, _tenant_name(session, job))
    return job


def resume_job(*, session: Session, settings: Settings, principal: Principal, job_id: str,
               control: PauseControl | None) -> FineTuningJob:
    """Resume a paused job: ``queued`` again, the hold released; it continues from its newest
    checkpoint when Slurm starts it. Conflict (409) unless it is paused."""
    from gateway.errors import SlurmError

    job = get_job(session=session, principal=principal, job_id=job_id)     # a foreign id: 404 in any mode
    if control is None or settings.local:
        raise Conflict("pausing needs Slurm: this gateway runs jobs in local mode", code="not_supported")
    if job.status != JobState.PAUSED.value:
        raise Conflict(f"job {job_id} is {job.status}: only a paused job can resume", code="invalid_state")
    # Slurm first: if the release fails the job stays paused (and held); if the state change
    # then loses a race, the reconciler holds it again when it starts (a paused job never runs)
    try:
        control.release(job.slurm_job_id, _tenant_name(session, job))
    except SlurmError as e:
        raise Conflict(f"Slurm did not release job {job_id} ({e}); it stays paused: try again",
                       code="busy") from None
    return _change(session, principal, job_id, Event.RESUME, {JobState.PAUSED},
                   "Resumed: queued again; it continues from its last checkpoint")


def delete_model(*, session: Session, settings: Settings, principal: Principal, job: FineTuningJob) -> None:
    """Delete a fine-tuned model: its result files, checkpoints and staging leave the tenant's
    storage (removed as the tenant, by name beneath its root: a link planted there is removed
    itself, never followed), and the job no longer names a model."""
    from gateway.services.files import file_parts
    from gateway.storage import storage_for

    assert principal.tenant_name is not None and job.tenant_id == principal.tenant_id
    paths: list[layout.Parts] = []
    for f in session.exec(select(DataFile).where(DataFile.job_id == job.id, col(DataFile.deleted_at).is_(None))):
        f.deleted_at = utcnow()
        session.add(f)
        if f.path:
            paths.append(file_parts(f)[:2])          # the whole artifacts/<art id>/ dir
    paths += layout.training_state(job.id)
    update_fields(session, job, fine_tuned_model=None)
    storage_for(settings).tenant(principal.tenant_name).remove(sorted(set(paths)))


def fine_tuned_models(*, session: Session, principal: Principal) -> list[FineTuningJob]:
    """The caller's jobs that name a fine-tuned model; none for a principal without a tenant."""
    if principal.tenant_id is None or not principal.tenant_name:
        return []
    return list(session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == principal.tenant_id,
                                                         col(FineTuningJob.fine_tuned_model).is_not(None))))


def delete_fine_tuned_model(*, session: Session, settings: Settings, principal: Principal, model_id: str) -> None:
    """Delete the tenant's fine-tuned model ``model_id`` (``delete_model``). Raises Forbidden for a
    principal without a tenant, ServiceError (``forbidden``) for a base model, NotFound otherwise."""
    from trainer import catalog

    tid = tenant_id_of(principal)
    job = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tid,
                                                   FineTuningJob.fine_tuned_model == model_id)).first()
    if job is None:
        if any(e.name == model_id for e in catalog.list_models(settings.models_root)):
            raise ServiceError("base models are managed by the administrators", code="forbidden")
        raise NotFound(f"no such model: {model_id}", param="model")
    delete_model(session=session, settings=settings, principal=principal, job=job)
