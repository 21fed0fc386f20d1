"""The gateway's FastAPI application."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.access import members
from gateway.access.policy import Policy, undeclared_routes
from gateway.api import deletion, files, jobs, metrics, models, registry, signin, staff, sweeps, usage, webhooks
from gateway.api.deps import PrincipalCache, access
from gateway.api.errors import COMMON_ERRORS, error_body, strip_422
from gateway.api.limits import BodyLimit
from gateway.config import Settings, get_settings
from gateway.errors import ServiceError
from gateway.jobs.backend import build_backend
from gateway.portal import STATIC_DIR, STATIC_URL
from gateway.portal import router as portal_router
from gateway.services.cluster import Cluster

log = logging.getLogger("gateway.api")


def create_app(settings: Settings, *, run_migrations: bool = True, reconcile: bool = True,
               slurm: Any = None) -> FastAPI:
    """The app, bound to one database (migrated to head unless told not to).

    With a scheduler (``slurm`` given, else ``scheduler_for``: Slurm when it answers, or the
    local one in local mode), jobs are submitted through it and, when ``reconcile`` is set, a
    reconciler thread runs while the app serves.
    """
    from contextlib import asynccontextmanager

    from fastapi.staticfiles import StaticFiles


    backend = build_backend(settings, scheduler=slurm, run_migrations=run_migrations)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        import gc

        # Everything imported and built so far lives as long as the process: keep the collector from
        # scanning it again and again (a full collection over it is a ~100 ms pause under load).
        gc.collect()
        gc.freeze()
        thread = None
        if app.state.reconciler is not None and reconcile:
            import threading

            thread = threading.Thread(target=app.state.reconciler.run, name="reconciler", daemon=True)
            thread.start()
        yield
        if thread is not None:
            app.state.reconciler.stop.set()
            thread.join(10)


    app = FastAPI(title="slurm-finetune gateway", version="0.1.0", lifespan=lifespan, responses=COMMON_ERRORS)

    app.add_middleware(BodyLimit, max_bytes=settings.max_json_bytes)   # 413 for oversized bodies
    metrics.install(app)                                                # outermost: times everything
    app.state.settings = settings
    members.GROUPS.ttl_s = settings.membership_ttl_s
    app.state.engine = backend.engine

    app.state.principals = PrincipalCache(settings.token_cache_s) if settings.token_cache_s > 0 else None
    app.state.cluster = Cluster(backend.scheduler, settings)   # the admin pages' one door to Slurm
    app.state.submitter = backend.submitter
    app.state.reconciler = backend.reconciler
    app.include_router(files.router)
    app.include_router(jobs.router)
    app.include_router(models.router)
    app.include_router(registry.router)
    app.include_router(sweeps.router)
    app.include_router(webhooks.router)
    app.include_router(staff.router)
    app.include_router(signin.router)
    app.include_router(usage.router)
    app.include_router(deletion.router)
    app.include_router(metrics.router)
    app.include_router(portal_router)
    app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="portal-static")
    app.routes[-1].access = Policy.PUBLIC  # type: ignore[attr-defined]  # the portal's CSS/JS

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, e: ServiceError) -> JSONResponse:
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return JSONResponse(error_body(e.message, type_=kind, code=e.code, param=e.param),
                            status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        return JSONResponse(error_body(f"{where or 'request'}: {first.get('msg', 'invalid')}",
                                       type_="invalid_request_error", code="invalid_request",
                                       param=where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), type_="invalid_request_error",
                                       code=str(e.status_code)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))   # e.g. a 405's Allow

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        ref = uuid.uuid4().hex[:12]
        log.exception("internal error %s", ref)   # the stack trace stays in the server log
        return JSONResponse(error_body(f"internal error (reference {ref})", type_="server_error",
                                       code="internal"), status_code=500)

    @app.get("/healthz", include_in_schema=False, dependencies=[access(Policy.PUBLIC)])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    if undeclared := undeclared_routes(app):   # tests/unit/test_access_policy.py fails on these
        log.error("routes without an access policy (gateway.access): %s", ", ".join(undeclared))
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = files.declare_bounds(strip_422(default_openapi()), settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def worker_app() -> FastAPI:
    """One API worker of a multi-process `finetune serve`: the reconciler runs elsewhere."""
    return create_app(get_settings(), reconcile=False)
