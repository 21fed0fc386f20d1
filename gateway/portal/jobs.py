"""Job pages: create (with the estimate shown first), list, live detail, cancel with confirmation."""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Form, Query, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse
from sqlmodel import Session

from gateway.access.policy import Policy
from gateway.api.deps import SessionDep, SettingsDep
from gateway.config import Settings
from gateway.errors import NotFound, ServiceError
from gateway.models import DataFile, FileStatus, FineTuningJob
from gateway.portal.datasets import DATASETS, catalog_names
from gateway.portal.jobviews import (
    ACTIVE_STATES,
    FORM_LIMITS,
    INT_FIELDS,
    JobForm,
    badge,
    job_events,
    loss_series,
    parse_job_form,
    progress_view,
)
from gateway.portal.session import PortalUser, check_csrf
from gateway.portal.web import PortalRoute, UserDep, env, portal_access, render
from gateway.services import files as files_svc
from gateway.services import jobcontrol, jobcreate, jobreads
from gateway.state import Cleanup, JobState
from trainer.contract.spec import HYPERPARAMETER_DEFAULTS

router = APIRouter(prefix="/portal/jobs", route_class=PortalRoute, include_in_schema=False,
                   dependencies=[portal_access(Policy.TENANT)])
JOB_ID = r"^[A-Za-z0-9_-]{1,64}$"
env.globals.update(badge=badge, form_limits=FORM_LIMITS, hp_defaults=HYPERPARAMETER_DEFAULTS)  # ranges: the contract's


@router.get("")
def list_jobs(request: Request, session: SessionDep, user: UserDep,
              after: str | None = Query(None, pattern=JOB_ID)) -> Response:
    """The tenant's jobs, newest first, 50 a page (``after``: the last job id of the previous page)."""
    rows, more = jobreads.list_jobs(session=session, principal=user.principal, after=after, limit=50)
    return render(request, "jobs.html", user=user, jobs=rows, more=more,
                  next_after=rows[-1].id if rows and more else None,
                  progress={j.id: progress_view(j) for j in rows})


def _usable_files(session: Session, user: PortalUser) -> list[DataFile]:
    rows, _ = files_svc.list_files(session=session, principal=user.principal, purpose=DATASETS)
    return [r for r in rows if r.status == FileStatus.PROCESSED]


def _form_page(request: Request, session: Session, settings: Settings, user: PortalUser, form: JobForm,
               errors: dict[str, str] | None = None, status: int = 200) -> Response:
    files = _usable_files(session, user)
    return render(request, "job_new.html", user=user, form=form, errors=errors or {}, files=files,
                  models=catalog_names(settings), status=status,
                  checkpoint_every_steps=settings.checkpoint_every_steps,
                  estimate=_estimate(request, session, settings, user, form.training_file, form.epochs_value(),
                                     form.model),
                  no_backend=request.app.state.submitter is None)


def likely_training_file(files: list[DataFile]) -> str:
    """The dataset the form preselects: the one with the most examples (the newest of those), not simply
    the newest (which is often the validation file, uploaded last: issue 35); "" when there is none."""
    def examples(f: DataFile) -> int:
        n = ((f.validation or {}).get("stats") or {}).get("examples")
        return n if isinstance(n, int) else 0
    best = max(files, key=lambda f: (examples(f), f.created_at), default=None)
    return best.id if best is not None else ""


@router.get("/new")
def new_job(request: Request, session: SessionDep, settings: SettingsDep, user: UserDep,
            training_file: str | None = Query(None, pattern=JOB_ID)) -> Response:
    """The create form, with a fresh idempotency key preselecting ``training_file`` or the newest validated dataset."""
    form = JobForm(model=settings.default_model or "", training_file=training_file or "",
                   idempotency_key=secrets.token_urlsafe(16))
    if not form.training_file:
        form.training_file = likely_training_file(_usable_files(session, user))
    if form.training_file:   # the method the chosen file's format trains with
        try:
            form.method = jobcreate.method_for(files_svc.get_file(session=session, principal=user.principal,
                                                            file_id=form.training_file))
        except NotFound:
            pass
    return _form_page(request, session, settings, user, form)


def _estimate(request: Request, session: Session, settings: Settings, user: PortalUser,
              file_id: str, epochs: int | None, model: str = "") -> dict[str, Any] | None:
    """Tokens, minutes and QOS tier the job would get (the same functions admission uses) and, with
    a model, when it would start (``estimate_job``: the create API's dry run; None when it refuses)."""
    if not file_id or epochs is None:
        return None
    try:
        train = files_svc.get_file(session=session, principal=user.principal, file_id=file_id)
    except NotFound:
        return None
    tokens, minutes = jobcreate.estimate(settings, train, epochs)
    submitter = request.app.state.submitter
    qos = None
    if submitter is not None and user.principal.tenant_name:
        try:
            qos = submitter.qos_for(user.principal.tenant_name, minutes)
        except (ServiceError, KeyError):
            qos = None
    start = reason = None
    if submitter is not None and model and user.principal.tenant_name:
        try:
            dry = jobcreate.estimate_job(session=session, settings=settings, principal=user.principal, submit=submitter,
                                   req=jobcreate.JobRequest(training_file=file_id, model=model,
                                                      hyperparameters={"epochs": epochs},
                                                      method=jobcreate.method_for(train)))
            start, reason = dry.get("expected_start"), dry.get("start_detail")
        except (ServiceError, KeyError):
            pass
    return {"tokens": tokens, "minutes": minutes, "qos": qos, "epochs": epochs,
            "over": tokens > settings.max_tokens_per_job or minutes > settings.max_wall_min,
            "start": start, "start_now": start is not None and start <= time.time() + 5, "start_reason": reason,
            "start_at": datetime.fromtimestamp(start, UTC) if start else None}


@router.get("/estimate")
def estimate(request: Request, session: SessionDep, settings: SettingsDep, user: UserDep,
             training_file: str = Query("", max_length=64),
             epochs: int = Query(HYPERPARAMETER_DEFAULTS["epochs"], ge=INT_FIELDS["epochs"][0],
                                 le=INT_FIELDS["epochs"][1]),
             model: str = Query("", max_length=255)) -> Response:
    """JSON for the form's script: tokens, minutes, QOS tier and expected start; null for an unknown file."""
    est = _estimate(request, session, settings, user, training_file, epochs, model)
    return JSONResponse({"estimate": {k: v for k, v in est.items() if k != "start_at"} if est else None})


@router.post("")
async def create_job(request: Request, session: SessionDep, settings: SettingsDep, user: UserDep) -> Response:
    """Submit the create form (CSRF-checked): redirect to the new job, or the form again with the errors."""
    raw = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    check_csrf(user.csrf, raw.get("csrf"))
    form, req, errors = parse_job_form(raw)
    submitter = request.app.state.submitter
    if submitter is None:
        errors["form"] = "This gateway has no connection to Slurm right now: jobs cannot be submitted."
    if req is None or errors:
        return _form_page(request, session, settings, user, form, errors, status=400)
    try:
        job = jobcreate.create_job(session=session, settings=settings, principal=user.principal, req=req,
                             submit=submitter)
    except ServiceError as e:
        field = (e.param or "form").split(".")[-1]
        errors[field if field in JobForm.FIELDS else "form"] = e.message
        session.rollback()
        return _form_page(request, session, settings, user, form, errors, status=e.status)
    return RedirectResponse(f"/portal/jobs/{job.id}", status_code=303)


def _results(session: Session, user: PortalUser, job: FineTuningJob) -> list[DataFile]:
    out = []
    for fid in job.result_files or []:
        try:
            out.append(files_svc.get_file(session=session, principal=user.principal, file_id=fid))
        except NotFound:
            continue
    return out


def _live_context(session: Session, user: PortalUser, job: FineTuningJob) -> dict[str, Any]:
    events, _ = jobreads.list_events(session=session, principal=user.principal, job_id=job.id, after=None, limit=1000)
    return {"job": job, "events": job_events(events)[:50], "progress": progress_view(job),
            "checkpoints": jobreads.list_checkpoints(session=session, principal=user.principal, job_id=job.id),
            "results": _results(session, user, job), "series": loss_series(events),
            "can_cancel": job.status in ACTIVE_STATES and job.status != JobState.CANCELLING.value}


@router.get("/{job_id}")
def show_job(job_id: str, request: Request, session: SessionDep, user: UserDep) -> Response:
    """One job's page: progress, events, loss curve, checkpoints and results."""
    job = jobreads.get_job(session=session, principal=user.principal, job_id=job_id)
    return render(request, "job.html", user=user, **_live_context(session, user, job))


@router.get("/{job_id}/live")
def live(job_id: str, request: Request, session: SessionDep, user: UserDep) -> Response:
    """What the detail page's script polls: the live part as HTML, and the loss series."""
    job = jobreads.get_job(session=session, principal=user.principal, job_id=job_id)
    ctx = _live_context(session, user, job)
    parts = {name: env.get_template(f"_job_{name}.html").render(request=request, user=user, csrf=user.csrf, **ctx)
             for name in ("head", "live")}
    done = job.status not in ACTIVE_STATES and job.cleanup != Cleanup.PENDING
    return JSONResponse({"status": job.status, **parts, "series": ctx["series"], "done": done})


@router.post("/{job_id}/pause")
def pause(job_id: str, request: Request, session: SessionDep, settings: SettingsDep, user: UserDep,
          csrf: Annotated[str, Form(max_length=100)] = "") -> Response:
    """Pause the job (CSRF-checked) and go back to its page."""
    check_csrf(user.csrf, csrf)
    job = jobcontrol.pause_job(session=session, settings=settings, principal=user.principal, job_id=job_id,
                        control=request.app.state.reconciler)
    return RedirectResponse(f"/portal/jobs/{job.id}", status_code=303)


@router.post("/{job_id}/resume")
def resume(job_id: str, request: Request, session: SessionDep, settings: SettingsDep, user: UserDep,
           csrf: Annotated[str, Form(max_length=100)] = "") -> Response:
    """Resume the paused job (CSRF-checked) and go back to its page."""
    check_csrf(user.csrf, csrf)
    job = jobcontrol.resume_job(session=session, settings=settings, principal=user.principal, job_id=job_id,
                         control=request.app.state.reconciler)
    return RedirectResponse(f"/portal/jobs/{job.id}", status_code=303)


@router.get("/{job_id}/cancel")
def confirm_cancel(job_id: str, request: Request, session: SessionDep, user: UserDep) -> Response:
    """The page that asks to confirm a cancellation."""
    job = jobreads.get_job(session=session, principal=user.principal, job_id=job_id)
    return render(request, "job_cancel.html", user=user, job=job, progress=progress_view(job))


@router.post("/{job_id}/cancel")
def cancel(job_id: str, request: Request, session: SessionDep, user: UserDep,
           csrf: Annotated[str, Form(max_length=100)] = "") -> Response:
    """Cancel the job (CSRF-checked) and go back to its page."""
    check_csrf(user.csrf, csrf)
    job = jobcontrol.cancel_job(session=session, principal=user.principal, job_id=job_id,
                         reconciler=request.app.state.reconciler)
    return RedirectResponse(f"/portal/jobs/{job.id}", status_code=303)
