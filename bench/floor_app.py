"""The peer of bench/api.py: a bare FastAPI + SQLModel app serving the gateway's own job and event
rows, written the way FastAPI's and SQLModel's tutorials do it ("SQL (Relational) Databases",
"Read One Hero"): sync ``def`` routes, one ``Session`` per request from a dependency, a ``select``
scoped to the caller's tenant, the rows returned as plain dicts for FastAPI to encode.

It is a FLOOR, not a product: authentication is a dict lookup of the bearer token loaded once at
start (no token table, no revocation), no access policy, no metrics, no audit, no error shapes.
Run it like the gateway: ``uvicorn bench.floor_app:app --workers N`` with ``FLOOR_DB_URL`` and
``FLOOR_TOKENS`` (a JSON object token -> tenant id) in the environment.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Query
from sqlmodel import Session, col, create_engine, select

from gateway.models import FineTuningJob, JobEvent

# the same pool as the gateway's (gateway.db.make_engine): one connection per concurrent request, reused
_URL = os.environ["FLOOR_DB_URL"].replace("postgresql://", "postgresql+psycopg://", 1)
engine = create_engine(_URL, pool_size=40, max_overflow=8,
                       **({"connect_args": {"check_same_thread": False}} if _URL.startswith("sqlite") else {}))
TOKENS: dict[str, int] = json.loads(os.environ["FLOOR_TOKENS"])
app = FastAPI()


def get_session() -> Iterator[Session]:
    """One session per request (the tutorial's ``SessionDep``)."""
    with Session(engine) as session:
        yield session


def tenant(authorization: Annotated[str, Header()] = "") -> int:
    """The caller's tenant id, from an in-memory token map."""
    tid = TOKENS.get(authorization.removeprefix("Bearer ").strip())
    if tid is None:
        raise HTTPException(401, "invalid token")
    return tid


SessionDep = Annotated[Session, Depends(get_session)]
TenantDep = Annotated[int, Depends(tenant)]


def _job(row: FineTuningJob) -> dict[str, Any]:
    return row.model_dump(mode="json")


@app.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/v1/fine_tuning/jobs")
def list_jobs(session: SessionDep, tid: TenantDep, limit: int = Query(20, ge=1, le=100)) -> dict[str, Any]:
    rows = session.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tid)
                        .order_by(col(FineTuningJob.created_at).desc(), col(FineTuningJob.id).desc())
                        .limit(limit + 1)).all()
    return {"object": "list", "data": [_job(r) for r in rows[:limit]], "has_more": len(rows) > limit}


@app.get("/v1/fine_tuning/jobs/{job_id}")
def retrieve_job(job_id: str, session: SessionDep, tid: TenantDep) -> dict[str, Any]:
    row = session.exec(select(FineTuningJob).where(FineTuningJob.id == job_id,
                                                   FineTuningJob.tenant_id == tid)).first()
    if row is None:
        raise HTTPException(404, "no such job")
    return _job(row)


@app.get("/v1/fine_tuning/jobs/{job_id}/events")
def list_events(job_id: str, session: SessionDep, tid: TenantDep,
                limit: int = Query(20, ge=1, le=1000)) -> dict[str, Any]:
    if session.exec(select(FineTuningJob.id).where(FineTuningJob.id == job_id,
                                                   FineTuningJob.tenant_id == tid)).first() is None:
        raise HTTPException(404, "no such job")
    rows = session.exec(select(JobEvent).where(JobEvent.job_id == job_id)
                        .order_by(col(JobEvent.id).desc()).limit(limit + 1)).all()
    return {"object": "list", "data": [r.model_dump(mode="json") for r in rows[:limit]], "has_more": len(rows) > limit}
