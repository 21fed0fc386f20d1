"""Hyperparameter sweeps: one request, a small grid, one job per point, ONE Slurm job array.

``create_sweep`` expands the grid (the product of each hyperparameter's values, in the order
given), admits and records every run exactly as ``create_job`` would (``prepare_job``: the
same checks, the same limit of unfinished jobs, each run its own row, spec and directory),
commits them all, then submits them as the tasks of one job array under the tenant's account
and one QOS (``Submitter.array``); without Slurm (local mode) the runs are submitted one by
one. From then on each run is an ordinary job: the reconciler follows, requeues, pauses and
publishes it by its own Slurm job id. ``sweep_view`` compares the runs by validation loss
(the final eval on the sweep's validation file) and names the best one, which is promotable
like any model (``finetune models promote``).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from sqlmodel import Session, col, select

from gateway.access.tokens import Principal
from gateway.config import Settings
from gateway.errors import NotFound, ServiceError, SlurmError
from gateway.models import FineTuningJob, MlflowParentRun, Sweep, new_id, utcnow
from gateway.services import jobcontrol, jobcreate, jobreads, jobwrites, tracking
from gateway.state import ACTIVE, Event, FailReason, JobState, SweepState
from trainer.contract.spec import JobSpec

log = logging.getLogger(__name__)

GRID_KEYS = ("learning_rate", "epochs", "lora_r", "lora_alpha", "lora_dropout", "batch_size_tokens", "warmup_ratio",
             "weight_decay")
"""What a grid may vary: the training knobs (not the data, base or resources, which a sweep shares), by our
names (the API also takes OpenAI's for them and translates each point: ``gateway.api.openai``)."""
MAX_VALUES = 8        # per hyperparameter


@dataclass
class SweepRequest:
    training_file: str
    validation_file: str | None
    model: str
    grid: dict[str, list[Any]]                                       # as the request gave it (recorded, shown)
    hyperparameters: dict[str, Any] = field(default_factory=dict)   # shared by every run (our names)
    points: list[dict[str, Any]] | None = None   # each run's by our names (the API's translation); None: the grid's
    suffix: str | None = None
    seed: int | None = None
    integrations: list[Any] | None = None    # as the request gave them (services.tracking checks them)


@runtime_checkable
class ArraySubmit(Protocol):
    """A ``Submit`` that can also submit several jobs as one job array (``Submitter``)."""

    def __call__(self, job: FineTuningJob, spec: JobSpec, tenant: str) -> tuple[int, str]: ...

    def qos_for(self, tenant: str, minutes: int, gpus: int = 1) -> str:
        """The QOS a job of ``minutes`` on ``gpus`` GPUs gets."""
        ...

    def array(self, jobs: list[FineTuningJob], specs: list[JobSpec], tenant: str,
              name: str) -> tuple[int, list[int], str]:
        """Submit ``jobs`` as one job array: (array id, each job's Slurm job id, qos)."""
        ...


def expand(grid: dict[str, list[Any]], max_runs: int,
           allowed: tuple[str, ...] | None = GRID_KEYS) -> list[dict[str, Any]]:
    """The grid's points (one hyperparameter dict each), the last key varying fastest. ServiceError
    (400, naming the field) for a key a grid may not vary, an empty, repeated or non-scalar value
    list, or more than ``max_runs`` points. ``allowed``: the names a grid may vary (None: a recorded grid,
    checked when it was created)."""
    if not isinstance(grid, dict) or not grid:
        raise ServiceError("grid must name at least one hyperparameter and its values", param="grid")
    for key, values in grid.items():
        if allowed is not None and key not in allowed:
            raise ServiceError(f"grid.{key}: a sweep varies only {', '.join(allowed)}", param=f"grid.{key}")
        if not isinstance(values, list) or not 1 <= len(values) <= MAX_VALUES:
            raise ServiceError(f"grid.{key} must be a list of 1 to {MAX_VALUES} values", param=f"grid.{key}")
        if not all(isinstance(v, int | float | str) and not isinstance(v, bool) for v in values) \
                or len({repr(v) for v in values}) != len(values):
            raise ServiceError(f"grid.{key}: values must be distinct numbers", param=f"grid.{key}")
    total = 1
    for values in grid.values():
        total *= len(values)
    if total > max_runs:
        raise ServiceError(f"the grid has {total} points; a sweep runs at most {max_runs}", param="grid")
    keys = list(grid)
    return [dict(zip(keys, point, strict=True)) for point in itertools.product(*(grid[k] for k in keys))]


def check_files(*, session: Session, principal: Principal, training_file: str, validation_file: str | None) -> None:
    """Both files of a sweep usable by the caller: 404 for a file that is not the tenant's, 400 without
    a validation file. The API calls it before it expands and translates the grid, so a request naming
    missing files is answered 404 whatever its grid holds (as one job's is), and ``create_sweep`` again.

    Raises:
        ServiceError: 400 without ``validation_file``; NotFound (404) for a file that is not the tenant's.
    """
    if not validation_file:
        raise ServiceError("a sweep compares its runs by validation loss: give validation_file",
                           param="validation_file")
    for param, file_id in (("training_file", training_file), ("validation_file", validation_file)):
        jobcreate.usable_file(session, principal, file_id, param)


def create_sweep(*, session: Session, settings: Settings, principal: Principal, req: SweepRequest,
                 submit: jobcreate.Submit) -> Sweep:
    """Validate, admit and record every run, then submit them as one job array (see the module doc).
    A run that fails its checks refuses the whole sweep (400/404, nothing recorded); a refused
    sbatch fails every run with Slurm's words, as ``submit_job`` does for one job."""
    tid = jobreads.tenant_id_of(principal)
    assert principal.tenant_name is not None
    check_files(session=session, principal=principal, training_file=req.training_file,
                validation_file=req.validation_file)
    integrations = tracking.parse(req.integrations, settings)
    shared = req.hyperparameters             # our names, as the grid's (gateway.api.openai translated OpenAI's)
    points = req.points if req.points is not None else expand(req.grid, settings.max_sweep_runs)
    overlap = sorted(set(points[0]) & set(shared))
    if overlap:
        raise ServiceError(f"hyperparameters.{overlap[0]} is also in the grid: give it in one place",
                           param=f"hyperparameters.{overlap[0]}")
    sweep = Sweep(id=new_id("ftsweep"), tenant_id=tid, model=req.model, grid=req.grid, job_ids=[],
                  suffix=req.suffix)
    runs: list[tuple[FineTuningJob, JobSpec]] = []
    for point in points:           # every run checked and admitted before anything is written
        run = jobcreate.JobRequest(training_file=req.training_file, model=req.model,
                                  validation_file=req.validation_file,
                                  hyperparameters={**req.hyperparameters, **point}, suffix=req.suffix, seed=req.seed)
        runs.append(jobcreate.prepare_job(session=session, settings=settings, principal=principal, req=run,
                                         submit=submit, sweep_id=sweep.id, pending=len(runs)))
    sweep.job_ids = [job.id for job, _ in runs]
    session.add(sweep)
    for task, (job, _) in enumerate(runs):
        job.integrations = [{**it.public(), "mlflow": {**it.public()["mlflow"], "run_name":
                                                       tracking.run_name_of(it, sweep, task)}}
                            for it in integrations] or None
        session.add(job)
        session.flush()
        jobwrites.add_event(session, job.id, f"Created fine-tuning job: {job.id} (run of sweep {sweep.id})")
    tracking.attach_sweep(session, sweep, [job for job, _ in runs], integrations, settings)
    session.commit()
    tenant = principal.tenant_name
    if settings.local or not isinstance(submit, ArraySubmit):
        for job, spec in runs:
            jobcreate.submit_job(session=session, job=job, spec=spec, tenant=tenant, submit=submit)
        return sweep
    _submit_array(session, sweep, runs, tenant, submit)
    return sweep


def _submit_array(session: Session, sweep: Sweep, runs: list[tuple[FineTuningJob, JobSpec]],
                  tenant: str, submit: ArraySubmit) -> None:
    jobs, specs = [job for job, _ in runs], [spec for _, spec in runs]
    try:
        array_id, ids, qos = submit.array(jobs, specs, tenant, sweep.id)
    except SlurmError as e:
        msg = getattr(e, "message", str(e))
        for job in jobs:
            jobwrites.apply_event(session, job, Event.ERROR, level="error",
                                 message=f"Submission of sweep {sweep.id} to Slurm failed: {msg}",
                                 error={"code": "submission_failed", "message": msg, "param": None,
                                        "reason": FailReason.INTERNAL.value},
                                 finished_at=utcnow())
        session.commit()
        return
    for task, (job, slurm_id) in enumerate(zip(jobs, ids, strict=True)):
        jobwrites.apply_event(session, job, Event.SUBMITTED,
                             message=f"Job queued as task {task} of Slurm job array {array_id} "
                                     f"(Slurm job {slurm_id}, QOS {qos})",
                             slurm_job_id=slurm_id, qos=qos)
    sweep.slurm_array_id = array_id
    session.add(sweep)
    session.commit()


def get_sweep(*, session: Session, principal: Principal, sweep_id: str) -> Sweep:
    """The caller's sweep; NotFound (404) otherwise, another tenant's included."""
    tid = jobreads.tenant_id_of(principal)
    sweep = session.get(Sweep, sweep_id)
    if sweep is None or sweep.tenant_id != tid:
        raise NotFound(f"no such sweep: {sweep_id}", param="sweep_id")
    return sweep


def list_sweeps(*, session: Session, principal: Principal, limit: int = 20) -> list[Sweep]:
    """The caller's sweeps, newest first."""
    tid = jobreads.tenant_id_of(principal)
    return list(session.exec(select(Sweep).where(Sweep.tenant_id == tid)
                             .order_by(col(Sweep.created_at).desc()).limit(limit)))


def sweep_jobs(session: Session, sweep: Sweep) -> list[FineTuningJob]:
    """The sweep's runs in task order."""
    rows = {j.id: j for j in session.exec(select(FineTuningJob).where(
        FineTuningJob.sweep_id == sweep.id, FineTuningJob.tenant_id == sweep.tenant_id))}
    return [rows[i] for i in sweep.job_ids if i in rows]


def _valid_loss(job: FineTuningJob) -> float | None:
    """The run's final validation loss: the published record's, else the last "after" eval."""
    after = ((job.lineage or {}).get("eval") or {}).get("after")
    if isinstance(after, int | float):
        return float(after)
    evals = [e for e in (job.progress or {}).get("evals") or [] if isinstance(e, dict) and e.get("when") == "after"]
    loss = evals[-1].get("loss") if evals else None
    return float(loss) if isinstance(loss, int | float) and not isinstance(loss, bool) else None


def sweep_view(session: Session, sweep: Sweep) -> dict[str, Any]:
    """The comparison: every run's point, status, validation loss and eval curve, and the best run
    (the lowest validation loss among the succeeded ones; None until one has succeeded)."""
    points = expand(sweep.grid, max(len(sweep.job_ids), 1), allowed=None)   # as the request named them
    runs: list[dict[str, Any]] = []
    for task, job in enumerate(sweep_jobs(session, sweep)):
        curve = [[e["step"], e["loss"]] for e in (job.progress or {}).get("evals") or []
                 if isinstance(e, dict) and isinstance(e.get("step"), int) and isinstance(e.get("loss"), int | float)]
        runs.append({"task": task, "job_id": job.id, "status": job.status,
                     "hyperparameters": points[task] if task < len(points) else {},
                     "slurm_job_id": job.slurm_job_id, "valid_loss": _valid_loss(job),
                     "fine_tuned_model": job.fine_tuned_model, "eval_curve": curve})
    done = [r for r in runs if r["status"] == JobState.SUCCEEDED and r["valid_loss"] is not None]
    best = min(done, key=lambda r: r["valid_loss"]) if done else None
    states = {r["status"] for r in runs}
    status = (SweepState.RUNNING if states & {s.value for s in ACTIVE} else
              SweepState.SUCCEEDED if states == {JobState.SUCCEEDED.value} else SweepState.FINISHED)
    parents = session.exec(select(MlflowParentRun).where(MlflowParentRun.sweep_id == sweep.id)).all()
    integrations = [{"type": "mlflow", "mlflow": {"tracking_uri": p.tracking_uri, "experiment": p.experiment,
                                                  "run_name": p.run_name}} for p in parents]   # never a credential
    return {"object": "fine_tuning.sweep", "id": sweep.id, "created_at": int(sweep.created_at.timestamp()),
            "model": sweep.model, "grid": sweep.grid, "status": status.value, "slurm_array_id": sweep.slurm_array_id,
            "integrations": integrations,
            "runs": runs, "best": best and {k: best[k] for k in ("job_id", "fine_tuned_model", "valid_loss",
                                                                "hyperparameters")}}


def cancel_sweep(*, session: Session, principal: Principal, sweep_id: str) -> Sweep:
    """Cancel every unfinished run of the caller's sweep (each as ``request_cancel``)."""
    sweep = get_sweep(session=session, principal=principal, sweep_id=sweep_id)
    for job in sweep_jobs(session, sweep):
        if JobState(job.status) in ACTIVE:
            try:
                jobcontrol.request_cancel(session=session, principal=principal, job_id=job.id)
            except ServiceError as e:      # it finished meanwhile
                log.info("sweep %s: run %s not cancelled: %s", sweep.id, job.id, e)
    return sweep
