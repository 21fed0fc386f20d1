"""/v1/fine_tuning/sweeps: a hyperparameter grid run as one Slurm job array, compared by validation loss."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from gateway.access.policy import Policy
from gateway.api import openai
from gateway.api.deps import PrincipalDep, SessionDep, SettingsDep, access
from gateway.api.jobs import JOB_ID
from gateway.errors import ServiceError
from gateway.services import sweeps as svc

router = APIRouter(prefix="/v1/fine_tuning/sweeps", tags=["fine-tuning"], dependencies=[access(Policy.TENANT)])

Value = int | float


class CreateSweep(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[str, Field(min_length=1, max_length=255)]
    training_file: Annotated[str, Field(pattern=JOB_ID)]
    validation_file: Annotated[str, Field(pattern=JOB_ID)]
    grid: Annotated[dict[Literal[svc.GRID_KEYS + tuple(openai.OURS)],     # type: ignore[valid-type]
                         Annotated[list[Value], Field(min_length=1, max_length=svc.MAX_VALUES,
                                                      json_schema_extra={"uniqueItems": True})]],
                    Field(min_length=1, max_length=len(svc.GRID_KEYS) + len(openai.OURS))]
    hyperparameters: dict[str, Any] | None = None        # shared by every run
    suffix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    # as a job's: {"type": "mlflow", ...}; the sweep logs a parent run, each of its jobs a child run
    integrations: Annotated[list[Any], Field(max_length=16)] | None = None


@router.post("")
def create_sweep(body: CreateSweep, request: Request, session: SessionDep, settings: SettingsDep,
                 principal: PrincipalDep) -> dict[str, Any]:
    """Expand the grid into one job per point and submit them as ONE Slurm job array."""
    submitter = request.app.state.submitter
    if submitter is None:
        raise ServiceError("this gateway has no Slurm connection: jobs cannot run", code="no_backend")
    svc.check_files(session=session, principal=principal, training_file=body.training_file,
                    validation_file=body.validation_file)
    points = svc.expand(dict(body.grid), settings.max_sweep_runs, svc.GRID_KEYS + tuple(openai.OURS))
    req = svc.SweepRequest(training_file=body.training_file, validation_file=body.validation_file,
                           model=body.model, grid=dict(body.grid), points=[openai.to_ours(p, "grid") for p in points],
                           hyperparameters=openai.to_ours(body.hyperparameters or {}),
                           suffix=body.suffix, seed=body.seed, integrations=body.integrations)
    sweep = svc.create_sweep(session=session, settings=settings, principal=principal, req=req, submit=submitter)
    return svc.sweep_view(session, sweep)


@router.get("")
def list_sweeps(session: SessionDep, principal: PrincipalDep,
                limit: int = Query(20, ge=1, le=100)) -> dict[str, Any]:
    """The tenant's sweeps, newest first, each with its comparison."""
    rows = svc.list_sweeps(session=session, principal=principal, limit=limit)
    return {"object": "list", "data": [svc.sweep_view(session, s) for s in rows], "has_more": False}


@router.get("/{sweep_id}")
def retrieve_sweep(sweep_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """One sweep: its runs side by side and the best by validation loss; 404 for another tenant's."""
    return svc.sweep_view(session, svc.get_sweep(session=session, principal=principal, sweep_id=sweep_id))


@router.post("/{sweep_id}/cancel")
def cancel_sweep(sweep_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """Cancel every unfinished run of the sweep."""
    return svc.sweep_view(session, svc.cancel_sweep(session=session, principal=principal, sweep_id=sweep_id))
