"""Creating a fine-tuning job: files checked, the base model or parent found, admission
(the tenant's limits, GPUs its QOS tiers allow, memory), the row recorded, then sbatch.

The row is committed before sbatch, so a crash loses nothing (the reconciler adopts or
resubmits it); ``prepare_job`` is the first half, shared with sweeps and the estimate.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from gateway.access.tokens import Principal, who
from gateway.config import Settings
from gateway.datasets.tokencount import counter_for
from gateway.errors import Conflict, NotFound, ServiceError, SlurmError, TooManyJobs
from gateway.models import DataFile, FileStatus, FineTuningJob, utcnow
from gateway.services import autohp, retention, tracking
from gateway.services.checkpointpub import UNPUBLISHED_ENDS, publish_checkpoints
from gateway.services.files import get_file
from gateway.services.jobmemory import _model_shape, memory_check, widen_for_ranks
from gateway.services.jobmodels import CHECKPOINT_MODEL, checkpoint_files, checkpoint_model_name, find_checkpoint_model
from gateway.services.jobreads import get_job, tenant_id_of
from gateway.services.jobspec import AUTO, _epochs, job_spec
from gateway.services.jobwrites import add_event, apply_event
from gateway.services.speed import Speed, expected_seconds, measured_speed, site_speed
from gateway.state import ACTIVE, TERMINAL, Event, FailReason, JobState
from gateway.storage import storage_for
from trainer.contract.spec import HYPERPARAMETER_DEFAULTS, Hyperparameters, JobSpec

if TYPE_CHECKING:
    from trainer.catalog import CatalogEntry
    from trainer.memory import ModelShape


class Submit(Protocol):
    """``submit(job, spec, tenant) -> (scheduler job id, qos)``: ``jobs.submission.Submitter``."""

    def __call__(self, job: FineTuningJob, spec: JobSpec, tenant: str) -> tuple[int, str]:
        """Submit ``job`` as ``tenant``; return the scheduler's job id and the QOS tier used."""
        ...

    def qos_for(self, tenant: str, minutes: int, gpus: int = 1) -> str:
        """The QOS tier a job of ``minutes`` on ``gpus`` GPUs would get; ServiceError naming the limit
        when none of the tenant's tiers allows that many GPUs."""
        ...


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobRequest:
    training_file: str
    model: str
    validation_file: str | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)   # ours (gateway.api.openai translates OpenAI's)
    suffix: str | None = None
    seed: int | None = None
    metadata: dict[str, str] | None = None
    idempotency_key: str | None = None
    gpus: int = 1           # in all: one trainer rank each
    nodes: int = 1
    fsdp: bool = False      # shard the model over the ranks
    from_checkpoint: str | None = None   # "<job id>[:<step>]": continue from that job's checkpoint (Together's way)
    method: str = "supervised"           # or "dpo": preference pairs (METHODS)
    integrations: list[Any] | None = None   # as the request gave them (services.tracking checks them)
    time_limit_min: int | None = None       # the requester's time limit instead of the estimate's

    def digest(self) -> str:
        """sha256 of the request without its idempotency key: a reused key must come with the same request."""
        # fields at their defaults that came later are left out: a retry of an older request keeps its digest
        fields = {k: v for k, v in self.__dict__.items()
                  if k != "idempotency_key"
                  and not (k in ("fsdp", "from_checkpoint", "integrations", "time_limit_min") and not v)
                  and not (k == "method" and v == "supervised")}
        if self.integrations:
            fields["integrations"] = tracking.redacted(self.integrations)
        body = json.dumps(fields,
                          sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()


def usable_file(session: Session, principal: Principal, file_id: str, param: str) -> DataFile:
    """The caller's processed file ``file_id`` (NotFound naming ``param``; ServiceError if not processed, or
    expired or past its tenant's retention: ``services.retention.file_due``)."""
    try:
        row = get_file(session=session, principal=principal, file_id=file_id)
    except NotFound as e:
        raise NotFound(f"no such file: {file_id}", param=param) from e
    if row.status != FileStatus.PROCESSED:
        raise ServiceError(f"file {file_id} has status {row.status!r}: only validated files "
                           f"(status 'processed') can be used for training ({row.status_details or ''})",
                           param=param, code="invalid_file")
    if (due := retention.file_due(session, row, utcnow())) is not None:
        raise ServiceError(f"file {file_id} is {due} and is being deleted: it cannot start a job; upload it "
                           "again", param=param, code="invalid_file")
    return row


METHODS = {"supervised": "chat", "dpo": "preference"}
"""Each training method and the dataset format it trains on (the upload validator's ``stats.format``)."""


def _stats(row: DataFile) -> dict[str, Any]:
    """File ``row``'s validation statistics (``{}`` for a file validated before they existed)."""
    return dict((row.validation or {}).get("stats") or {})


def _file_format(row: DataFile) -> str:
    """File ``row``'s format as its validation found it (a file validated before formats existed is chat)."""
    return str(_stats(row).get("format") or "chat")


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


def _tool_lines(row: DataFile) -> int:
    """How many lines of file ``row`` declare tools (its validation's ``stats.tools``)."""
    return int((_stats(row).get("tools") or {}).get("lines_with_tools") or 0)


def tools_fit(settings: Settings, entry: CatalogEntry, files: dict[str, DataFile | None]) -> None:
    """ServiceError (400, ``model_cannot_call_tools``) when a file of ``files`` (by request field)
    declares tools and base model ``entry``'s chat template does not render them
    (``CatalogEntry.tool_calling``, found at ``models add``; asked of the tokenizer for an entry
    added before it): its calls would train as empty turns."""
    param = next((p for p, row in files.items() if row is not None and _tool_lines(row)), None)
    if param is None or entry.tool_calling:
        return
    base = entry.name
    if entry.tool_calling is None:
        from trainer import catalog  # lazy: the trainer side (catalog), only for a tool-calling file

        counter = counter_for(settings.models_root, base)
        if counter is not None and catalog.renders_tools(counter.tok):
            return
    row = files[param]
    assert row is not None
    raise ServiceError(f"{param} {row.id} has {_tool_lines(row)} line(s) that declare tools, but the chat "
                       f"template of base model {base} does not render tools or tool calls, so they cannot "
                       "be trained; pick a base model whose template does (GET /v1/models shows "
                       "capabilities.tool_calling), or leave the tool calls out",
                       param="model", code="model_cannot_call_tools")


def longest_example(row: DataFile) -> int | None:
    """The most tokens an example of file ``row`` holds by its validation's counts (a pair: prompt + its
    longer side, what a DPO step holds), or None when they were not counted."""
    stats = _stats(row)
    pref = stats.get("preference") or {}
    if pref:
        sides = [(pref.get(side) or {}).get("max") for side in ("chosen", "rejected")]
        counted = [v for v in sides if isinstance(v, int)]
        return max(counted) if counted else None
    longest = (stats.get("tokens") or {}).get("max")
    return longest if isinstance(longest, int) else None


def lengths_fit(hp: dict[str, Any], base: str, files: dict[str, DataFile | None]) -> None:
    """ServiceError (400, naming ``hyperparameters.max_seq_len``) when a file's longest example, counted
    with base model ``base``'s own tokenizer at upload, is over the job's ``max_seq_len``: the job would
    fail at tokenizing on its node, after waiting in the queue. A file counted with another model's
    tokenizer is left to the trainer (its counts are not this base's)."""
    limit = int(hp.get("max_seq_len", HYPERPARAMETER_DEFAULTS["max_seq_len"]))
    for param, row in files.items():
        if row is None or _stats(row).get("tokenizer") != base:
            continue
        longest = longest_example(row)
        if longest is not None and longest > limit:
            raise ServiceError(
                f"{param} {row.id}: its longest example is {longest} tokens in {base}'s tokenizer, over "
                f"hyperparameters.max_seq_len ({limit}), so the job would fail when it tokenizes the file; "
                f"set max_seq_len to at least {longest} (batch_size_tokens at least as much), or shorten "
                "those examples", param="hyperparameters.max_seq_len")


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
    from trainer import catalog  # lazy: the trainer side (catalog), only when a base model is looked up

    entries = catalog.list_models(settings.models_root)
    for e in entries:
        if e.name == name:
            return e
    names = ", ".join(sorted({e.name for e in entries})) or "none registered"
    raise ServiceError(f"unknown base model {name!r}; available: {names}", param="model",
                       code="model_not_found")


def estimate(settings: Settings, train: DataFile, epochs: int, gpus: int = 1,
             speed: Speed | None = None) -> tuple[int, int]:
    """(training tokens, time limit in minutes) for --time: backfill can place small jobs. The limit
    is 1.5x :func:`expected_seconds`, at least 5 minutes (a busy node, a slow start)."""
    stats = _stats(train)
    tokens = (stats.get("tokens") or {}).get("total") or max(1, train.bytes // 4)
    training_tokens = int(tokens) * epochs
    seconds = expected_seconds(settings, training_tokens, gpus, speed)
    return training_tokens, max(5, math.ceil(1.5 * seconds / 60))


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
    integrations = tracking.parse(req.integrations, settings)
    job, spec = prepare_job(session=session, settings=settings, principal=principal, req=req, submit=submit)
    job.integrations = [it.public() for it in integrations] or None
    try:
        with session.begin_nested():      # the write lock only from here (SQLite): checks and sacctmgr ran before
            session.add(job)
            session.flush()
            tracking.attach(session, job, integrations, settings)
    except IntegrityError:
        existing = session.exec(select(FineTuningJob).where(
            FineTuningJob.tenant_id == tid, FineTuningJob.idempotency_key == req.idempotency_key)).first()
        if existing is None:
            raise
        return _same_request(existing, req)
    add_event(session, job.id, f"Created fine-tuning job: {job.id}")
    if (note := _widened(job)) is not None:
        add_event(session, job.id, note, level="warning")
    session.commit()
    assert principal.tenant_name is not None
    submit_job(session=session, job=job, spec=spec, tenant=principal.tenant_name, submit=submit)
    return job


def _widened(job: FineTuningJob) -> str | None:
    """The note for ``job``'s event log when its chosen ``batch_size_tokens`` was widened for its ranks
    (``autohp.batch_tokens``), else None."""
    hp = job.hyperparameters or {}
    before = (hp.get(AUTO) or {}).get("widened_from")
    if before is None:
        return None
    budget = hp["batch_size_tokens"]
    return (f"batch_size_tokens widened from the chosen {before} to {budget} so that each of the {job.gpus} "
            f"ranks has a row of {budget // job.gpus} tokens every step")


def epochs_admitted(settings: Settings, train: DataFile, gpus: int, speed: Speed | None = None) -> int:
    """The most epochs of ``train`` (up to ``autohp.MAX_DEFAULT_EPOCHS``) that the site's limits on
    tokens and time admit (:func:`_admit`), at least 1: the cap of the epochs ``auto`` chooses, so that
    ``auto`` never makes a job admission refuses."""
    for epochs in range(autohp.MAX_DEFAULT_EPOCHS, 1, -1):
        tokens, minutes = estimate(settings, train, epochs, gpus, speed)
        if tokens <= settings.max_tokens_per_job and minutes <= settings.max_wall_min:
            return epochs
    return 1


def choose_auto(settings: Settings, train: DataFile, shape: ModelShape | None, hp: dict[str, Any],
                method: str, gpus: int, speed: Speed | None = None) -> None:
    """Fill ``hp`` (our names) with the ``auto`` values it leaves out (``autohp.choose``: from the
    training file's validation statistics and the base's parameter count) and record the choice
    under ``AUTO``. ServiceError (400) when the request itself names ``AUTO``."""
    if AUTO in hp:
        raise ServiceError(f"hyperparameters.{AUTO} is not a hyperparameter: give \"auto\" as a value instead "
                           f"(e.g. \"n_epochs\": \"auto\")", param=f"hyperparameters.{AUTO}")
    choice = autohp.choose(hp, autohp.DataFacts.from_validation(train.validation, train.bytes),
                           parameters=shape.parameters() if shape is not None else None, method=method,
                           gpus=gpus,
                           max_epochs=None if "epochs" in hp else epochs_admitted(settings, train, gpus, speed))
    hp.update(choice.values)
    hp[AUTO] = choice.record()


def prepare_job(*, session: Session, settings: Settings, principal: Principal, req: JobRequest,
                submit: Submit, sweep_id: str | None = None, pending: int = 0,
                check_memory: bool = True) -> tuple[FineTuningJob, JobSpec]:
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
    hp = dict(req.hyperparameters)    # our names (gateway.api.openai translated OpenAI's)
    model = _checkpoint_model(session, settings, principal, req) if req.from_checkpoint else req.model
    parent, init = _parent(session, principal, model, hp) if model.startswith("ft:") else (None, None)
    base = parent.model if parent is not None else model
    entry = _catalog_entry(settings, base)
    if parent is not None and parent.model_digest and entry.digest != parent.model_digest:
        raise ServiceError(f"the base model {base} changed since {model} was trained (digest "
                           f"{parent.model_digest}, now {entry.digest}): its adapter does not fit the new base",
                           param="model", code="model_changed")
    tools_fit(settings, entry, {"training_file": train, "validation_file": val})
    if req.seed is not None:
        hp["seed"] = req.seed
    check_resources(settings, req.gpus, req.nodes, req.fsdp)
    shape = _model_shape(settings, entry)
    speed = measured_speed(session, settings, base)     # this site's finished jobs of the model, if enough
    choose_auto(settings, train, shape, hp, req.method, req.gpus, speed)   # recorded: spec, recovery, estimate agree
    lengths_fit(hp, base, {"training_file": train, "validation_file": val})
    epochs = _epochs(hp)
    tokens, minutes = estimate(settings, train, epochs, req.gpus, speed)
    if req.time_limit_min is not None:       # the requester knows better (a slow machine, a retry): theirs
        minutes = req.time_limit_min
    _admit(session, settings, tid, tokens, minutes, pending)
    _gpus_allowed(submit, tenant_name, minutes, req.gpus)
    widen_for_ranks(hp, req.method, req.gpus)       # an explicit batch_size_tokens too small for the ranks
    job = FineTuningJob(tenant_id=tid, training_file=train.id, validation_file=val.id if val else None,
                        model=base, model_digest=entry.digest, hyperparameters=hp,
                        parent_model=model if parent is not None else None,
                        init_file=init.id if init is not None else None, sweep_id=sweep_id,
                        suffix=req.suffix, seed=req.seed, meta=req.metadata,
                        idempotency_key=req.idempotency_key, request_hash=req.digest(),
                        estimated_tokens=tokens, time_limit_min=minutes, gpus=req.gpus, nodes=req.nodes,
                        fsdp=req.fsdp, method=req.method, created_by=who(principal))
    spec = job_spec(settings, tenant_name, job, train, val, entry, init)  # validates hp before any row exists
    if check_memory and shape is not None and (check := memory_check(settings, spec, shape)).fits is False:
        raise ServiceError(check.refusal(), param="hyperparameters", code="insufficient_memory")
    return job, spec


def estimate_job(*, session: Session, settings: Settings, principal: Principal, req: JobRequest,
                 submit: Submit) -> dict[str, Any]:
    """A dry run of ``create_job``: the same checks and admission (the same errors), nothing written
    or submitted; returns what the job would take and when it would start (``Submitter.expected_start``)."""
    tracking.parse(req.integrations, settings)
    job, spec = prepare_job(session=session, settings=settings, principal=principal, req=req, submit=submit,
                            check_memory=False)
    minutes = job.time_limit_min or 60
    speed = measured_speed(session, settings, job.model)
    expected = expected_seconds(settings, job.estimated_tokens or 0, job.gpus, speed)
    out: dict[str, Any] = {"object": "fine_tuning.job.estimate", "model": job.model,
                           "estimated_tokens": job.estimated_tokens, "gpus": job.gpus, "nodes": job.nodes,
                           "time_limit_minutes": minutes, "expected_minutes": max(1, round(expected / 60)),
                           "expected_seconds": round(expected),
                           "gpu_hours": round(job.gpus * expected / 3600, 3),
                           "batch_size_tokens": (job.hyperparameters or {}).get("batch_size_tokens"),
                           "hyperparameters": dict(job.hyperparameters or {}),   # ours (the route adds OpenAI's)
                           "speed": _speed_source(settings, speed),
                           "warnings": [note] if (note := _widened(job)) else []}
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


def _speed_source(settings: Settings, speed: Speed | None) -> dict[str, Any]:
    """What the estimate's time came from: this site's finished jobs of the model, or the site's guess."""
    if speed is None:
        return {"source": "site guess", "tokens_per_s": round(site_speed(settings), 1)}
    return {"source": "measured", "tokens_per_s": round(speed.tokens_per_s, 1),
            "overhead_s": round(speed.overhead_s, 1), "jobs": speed.jobs, "tenants": speed.tenants}


LORA_SHAPE = ("lora_r", "lora_alpha", "target_modules")
"""Hyperparameters a continued job takes from its parent: the adapter's shape and scale."""


def _checkpoint_model(session: Session, settings: Settings, principal: Principal, req: JobRequest) -> str:
    """``from_checkpoint`` ("<job id>[:<step>]", the newest published checkpoint without a step) as the
    checkpoint's model name. ``model`` must name the same lineage: the job's base, its model or that
    checkpoint. NotFound (404) for a job or step that is not the tenant's published checkpoint."""
    assert req.from_checkpoint is not None
    job_id, _, raw_step = req.from_checkpoint.partition(":")
    try:
        job = get_job(session=session, principal=principal, job_id=job_id)
    except NotFound:
        raise NotFound(f"no such job: {job_id}", param="from_checkpoint") from None
    files = checkpoint_files(session, job) if job.status in TERMINAL else {}
    if not files and job.status in UNPUBLISHED_ENDS and principal.tenant_name is not None:
        # it ended unpublished and the reconciler's publication of its checkpoints did not happen
        publish_checkpoints(session=session, storage=storage_for(settings), job=job,
                            tenant_name=principal.tenant_name)
        files = checkpoint_files(session, job)
    step = int(raw_step) if raw_step.isdigit() else max(files, default=0)
    if step not in files:
        raise NotFound(f"job {job_id} has no complete checkpoint{f' at step {raw_step}' if raw_step else ''} "
                       f"({job.status}): a job's checkpoints become models when it ends (those it still kept)",
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


def submit_job(*, session: Session, job: FineTuningJob, spec: JobSpec, tenant: str,
               submit: Submit) -> None:
    """Run sbatch through ``submit`` and record the outcome (QUEUED, or FAILED with Slurm's words)."""
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
