"""/v1/fine_tuning/jobs: OpenAI-compatible fine-tuning jobs, scoped to the caller's tenant."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.access.policy import Policy
from gateway.api import openai
from gateway.api.deps import PrincipalDep, SessionDep, SettingsDep, access
from gateway.api.fastjson import FastJSON
from gateway.errors import ServiceError
from gateway.models import DataFile, FineTuningJob, JobCheckpoint, JobEvent
from gateway.services import jobcontrol, jobcreate, jobmodels, jobreads
from gateway.state import JobState
from trainer.contract.spec import HYPERPARAMETER_DEFAULTS, JOB_BOUNDS

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"], dependencies=[access(Policy.TENANT)])
JOB_ID = r"^[A-Za-z0-9_-]{1,64}$"


class Supervised(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: dict[str, Any] = Field(default_factory=dict)


class Dpo(BaseModel):
    """OpenAI's ``method.dpo``: its hyperparameters are the supervised ones plus ``beta``."""

    model_config = ConfigDict(extra="forbid")
    hyperparameters: dict[str, Any] = Field(default_factory=dict)


class Method(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["supervised", "dpo"] = "supervised"
    supervised: Supervised | None = None
    dpo: Dpo | None = None

    @model_validator(mode="after")
    def _settings_of_its_type(self) -> Method:
        other = "dpo" if self.type == "supervised" else "supervised"
        if getattr(self, other) is not None:
            raise ValueError(f"method.{other} given with method.type {self.type!r}: "
                             f"set method.type to {other!r}, or move the settings to method.{self.type}")
        return self


class Resources(BaseModel):
    """Ours: the GPUs a job trains on (one trainer rank each), spread over ``nodes``."""

    model_config = ConfigDict(extra="forbid")
    gpus: Annotated[int, Field(ge=1, le=JOB_BOUNDS["world_size"].high)] = 1   # one rank each: the spec's world_size
    nodes: Annotated[int, Field(ge=1, le=1024)] = 1
    fsdp: bool = False   # shard the 4-bit base over the ranks (FSDP2): for a model too large for one GPU
    # the job's time limit, instead of the estimate's (Slurm's --time; local mode's limit too)
    time_limit_minutes: Annotated[int, Field(ge=1, le=365 * 24 * 60)] | None = None


class CreateJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=255)]
    training_file: Annotated[str, Field(min_length=1, max_length=4096)]
    validation_file: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    hyperparameters: dict[str, Any] | None = None
    method: Method | None = None
    suffix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)
    # OpenAI's; here {"type": "mlflow", "mlflow": {...}} (services.tracking checks them, naming integrations[i])
    integrations: Annotated[list[Any], Field(max_length=16)] | None = None
    resources: Resources | None = None                                        # ours; default 1 GPU
    # Together's: continue from "<job id>[:<step>]" (the newest published checkpoint without a step)
    from_checkpoint: Annotated[str, Field(pattern=r"^ftjob-[0-9a-f]{24}(:[1-9][0-9]{0,8})?$")] | None = None

    @field_validator("training_file", "validation_file")
    @classmethod
    def _a_file_id(cls, value: str | None) -> str | None:
        """A file id (``file-...``), or a message that says what to do with a path given instead."""
        if value is None or re.fullmatch(JOB_ID, value):
            return value
        if "/" in value or value.endswith((".jsonl", ".json")):
            raise ValueError("this looks like a path, not a file id: upload the file first (POST /v1/files, or "
                             "`finetune files upload PATH`) and give the file id it returns (file-...)")
        raise ValueError("must be a file id (file-...) from POST /v1/files")


def _ts(dt: Any) -> int | None:
    return int(dt.timestamp()) if dt else None


def job_object(job: FineTuningJob | Any, tenant: str) -> dict[str, Any]:
    """OpenAI's fine_tuning.job plus ours: slurm_job_id, attempt, phase, cleanup, progress (``job``: the
    model, or a row of ``jobreads.JOB_VIEW``)."""
    hp = dict(job.hyperparameters or {})
    method = job.method or "supervised"
    if method == "dpo":
        hp.setdefault("beta", HYPERPARAMETER_DEFAULTS["beta"])
    openai_hp = openai.to_openai(hp)
    error = None
    if job.error:
        error = {"code": job.error.get("code"), "message": job.error.get("message"),
                 "param": job.error.get("param")}
    return {
        "object": "fine_tuning.job", "id": job.id, "model": job.parent_model or job.model,
        "created_at": _ts(job.created_at), "finished_at": _ts(job.finished_at),
        "fine_tuned_model": job.fine_tuned_model, "organization_id": tenant,
        "result_files": job.result_files or [], "status": job.status,
        "validation_file": job.validation_file, "training_file": job.training_file,
        "hyperparameters": openai_hp, "trained_tokens": job.trained_tokens, "error": error,
        "user_provided_suffix": job.suffix,
        "seed": job.seed if job.seed is not None else hp.get("seed", HYPERPARAMETER_DEFAULTS["seed"]),
        "estimated_finish": _ts(job.estimated_finish) if job.status in (JobState.QUEUED, JobState.RUNNING) else None,
        "expected_start": _ts(job.expected_start) if job.status == JobState.QUEUED else None,
        "integrations": job.integrations or [], "metadata": job.meta,     # never a credential (services.tracking)
        "method": {"type": method, method: {"hyperparameters": {**openai_hp, **openai.ours_shown(hp)}}},
        # ours
        "created_by": job.created_by,     # the person (or service token) who submitted it
        "slurm_job_id": job.slurm_job_id, "attempt": job.attempt, "phase": job.phase, "qos": job.qos,
        "resources": {"gpus": job.gpus, "nodes": job.nodes, "fsdp": job.fsdp,
                      "time_limit_minutes": job.time_limit_min or 60},
        "cleanup": job.cleanup, "stop_confirmed": job.stop_confirmed_at is not None,
        "progress": {k: v for k, v in (job.progress or {}).items() if k not in jobreads.INTERNAL_PROGRESS},
    }


def event_object(ev: JobEvent | Any) -> dict[str, Any]:
    """OpenAI's ``fine_tuning.job.event`` object (id ``ftevent-<n>``; ``ev``: the model, or a row of
    ``jobreads.EVENT_VIEW``)."""
    return {"object": "fine_tuning.job.event", "id": f"ftevent-{ev.id}", "created_at": _ts(ev.created_at),
            "level": ev.level, "message": ev.message, "data": ev.data or {}, "type": ev.type}


def checkpoint_object(ck: JobCheckpoint, job: FineTuningJob, adapter: DataFile | None = None) -> dict[str, Any]:
    """OpenAI's ``fine_tuning.job.checkpoint`` object (metrics without a value left out), plus ours:
    ``adapter_file``, the file of its adapter once the job has published it (else null)."""
    return {"object": "fine_tuning.job.checkpoint", "id": ck.id, "created_at": _ts(ck.created_at),
            "fine_tuned_model_checkpoint": jobmodels.checkpoint_model_name(job, ck.step),
            "fine_tuning_job_id": job.id, "step_number": ck.step,
            "metrics": {k: v for k, v in (ck.metrics or {}).items() if v is not None},
            "adapter_file": adapter.id if adapter is not None else None}


def _request(body: CreateJob, idempotency_key: str | None) -> jobcreate.JobRequest:
    hp = dict(body.hyperparameters or {})
    settings = body.method and (body.method.supervised or body.method.dpo)
    if settings:
        hp.update(settings.hyperparameters)
    hp = openai.to_ours(hp)     # services take our names
    return jobcreate.JobRequest(training_file=body.training_file, model=body.model,
                          validation_file=body.validation_file,
                          hyperparameters=hp, suffix=body.suffix, seed=body.seed, metadata=body.metadata,
                          idempotency_key=idempotency_key,
                          gpus=body.resources.gpus if body.resources else 1,
                          nodes=body.resources.nodes if body.resources else 1,
                          fsdp=body.resources.fsdp if body.resources else False,
                          time_limit_min=body.resources.time_limit_minutes if body.resources else None,
                          from_checkpoint=body.from_checkpoint,
                          method=body.method.type if body.method else "supervised",
                          integrations=body.integrations)


@router.post("")
def create_job(body: CreateJob, request: Request, session: SessionDep, settings: SettingsDep,
               principal: PrincipalDep,
               idempotency_key: Annotated[str | None, Header(max_length=255)] = None) -> dict[str, Any]:
    """Create a job (admission control, then sbatch as the tenant's unix user)."""
    submitter = request.app.state.submitter
    if submitter is None:
        raise ServiceError("this gateway has no Slurm connection: jobs cannot run", code="no_backend")
    assert principal.tenant_name is not None
    req = _request(body, idempotency_key)
    job = jobcreate.create_job(session=session, settings=settings, principal=principal, req=req, submit=submitter)
    assert principal.tenant_name is not None
    return job_object(job, principal.tenant_name)


@router.post("/estimate")
def estimate_job(body: CreateJob, request: Request, session: SessionDep, settings: SettingsDep,
                 principal: PrincipalDep) -> dict[str, Any]:
    """A dry run of create: tokens, time limit, GPU-hours, QOS tier and the expected start (with the
    reason when it is not now). Nothing is recorded or submitted; the same body, the same errors."""
    submitter = request.app.state.submitter
    if submitter is None:
        raise ServiceError("this gateway has no Slurm connection: jobs cannot run", code="no_backend")
    out = jobcreate.estimate_job(session=session, settings=settings, principal=principal, req=_request(body, None),
                                 submit=submitter)
    hp = out["hyperparameters"]
    out["hyperparameters"] = {**openai.to_openai(hp), **openai.ours_shown(hp)}   # as the job would show them
    return out


# The three hot reads are ``async def``: they run on the event loop, without a thread-pool hop (and its
# GIL hand-offs), since each is one or two indexed queries of a few rows (jobreads.read_*: Core rows, no ORM).
_METADATA_PARAM = re.compile(r"metadata\[(.{1,64})\]", re.S)


def metadata_query(items: list[tuple[str, str]]) -> dict[str, str]:
    """The ``metadata[key]=value`` filters of a list request (at most 16, keys and values within the
    limits a job's metadata has); ServiceError (400) naming the parameter otherwise."""
    found: dict[str, str] = {}
    for name, value in items:
        if not name.startswith("metadata"):
            continue
        m = _METADATA_PARAM.fullmatch(name)
        if m is None or len(value) > 512:
            raise ServiceError("filter by metadata as metadata[key]=value (a key of at most 64 characters, "
                               "a value of at most 512)", param=name[:80])
        found[m.group(1)] = value
    if len(found) > 16:
        raise ServiceError("at most 16 metadata filters", param="metadata")
    return found


@router.get("")
async def list_jobs(request: Request, session: SessionDep, principal: PrincipalDep,
                    after: str | None = Query(None, pattern=JOB_ID),
                    limit: int = Query(20, ge=1, le=100)) -> FastJSON:
    """List this tenant's fine-tuning jobs, newest first (OpenAI's cursor pagination: ``after`` a job id);
    ``metadata[key]=value`` query parameters (OpenAI's filter) keep the jobs whose metadata holds them."""
    metadata = metadata_query(request.query_params.multi_items())
    rows, more = jobreads.read_jobs(session=session, principal=principal, after=after, limit=limit,
                                    metadata=metadata)
    assert principal.tenant_name is not None
    return FastJSON({"object": "list", "data": [job_object(j, principal.tenant_name) for j in rows], "has_more": more})


@router.get("/{job_id}")
async def retrieve_job(job_id: str, session: SessionDep, principal: PrincipalDep) -> FastJSON:
    """One of this tenant's fine-tuning jobs; 404 for an unknown id."""
    job = jobreads.read_job(session=session, principal=principal, job_id=job_id)
    assert principal.tenant_name is not None
    return FastJSON(job_object(job, principal.tenant_name))


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str, request: Request, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """``cancelling`` at once; Slurm is told now; ``cancelled`` once Slurm confirms the stop."""
    job = jobcontrol.cancel_job(session=session, principal=principal, job_id=job_id,
                         reconciler=request.app.state.reconciler)
    assert principal.tenant_name is not None
    return job_object(job, principal.tenant_name)


@router.post("/{job_id}/pause")
def pause_job(job_id: str, request: Request, session: SessionDep, settings: SettingsDep,
              principal: PrincipalDep) -> dict[str, Any]:
    """``paused`` at once; Slurm holds the job and the trainer checkpoints and leaves its GPU."""
    job = jobcontrol.pause_job(session=session, settings=settings, principal=principal, job_id=job_id,
                        control=request.app.state.reconciler)
    assert principal.tenant_name is not None
    return job_object(job, principal.tenant_name)


@router.post("/{job_id}/resume")
def resume_job(job_id: str, request: Request, session: SessionDep, settings: SettingsDep,
               principal: PrincipalDep) -> dict[str, Any]:
    """``queued`` again; the hold is released and the job continues from its last checkpoint."""
    job = jobcontrol.resume_job(session=session, settings=settings, principal=principal, job_id=job_id,
                         control=request.app.state.reconciler)
    assert principal.tenant_name is not None
    return job_object(job, principal.tenant_name)


@router.get("/{job_id}/events")
async def list_events(job_id: str, session: SessionDep, principal: PrincipalDep,
                      after: str | None = Query(None, pattern=r"^ftevent-\d{1,18}$"),
                      limit: int = Query(20, ge=1, le=1000)) -> FastJSON:
    """A job's events, newest first; ``after`` (an event id) pages on to older ones."""
    cursor = int(after.removeprefix("ftevent-")) if after else None
    rows, more = jobreads.read_events(session=session, principal=principal, job_id=job_id, after=cursor, limit=limit)
    return FastJSON({"object": "list", "data": [event_object(e) for e in rows], "has_more": more})


@router.get("/{job_id}/checkpoints")
def list_checkpoints(job_id: str, session: SessionDep, principal: PrincipalDep,
                     limit: int = Query(10, ge=1, le=100)) -> FastJSON:
    """A job's checkpoints, highest step first (the first ``limit``; ``has_more`` is always false)."""
    job = jobreads.get_job(session=session, principal=principal, job_id=job_id)
    rows = jobreads.list_checkpoints(session=session, principal=principal, job_id=job_id)[:limit]
    files = jobmodels.checkpoint_files(session, job)
    return FastJSON({"object": "list", "data": [checkpoint_object(c, job, files.get(c.step)) for c in rows],
                     "has_more": False,
                     "first_id": rows[0].id if rows else None, "last_id": rows[-1].id if rows else None})
