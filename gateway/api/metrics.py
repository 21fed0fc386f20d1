"""``GET /metrics``: the Prometheus text format, for sysadmin tokens only.

One ``CollectorRegistry`` per app (never prometheus_client's global one: a process may hold
several apps). Requests are counted and timed by ``RequestMetrics``, an ASGI middleware, by
method, route template (``/v1/fine_tuning/jobs/{job_id}``, never the id: a bounded label set)
and status. Everything else is read when scraped (``StateCollector``): jobs by tenant, state
and phase, each running job's tokens/s and the age of its last line and checkpoint
(``services.operations``), and, from the in-process reconciler, its cycles, their seconds,
the failed ones by cause, the tenants' storage calls it gave up waiting for or skipped, and the
detectors' findings by rule.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlmodel import Session

from gateway.access.policy import Policy
from gateway.api.deps import access
from gateway.services import operations

router = APIRouter(include_in_schema=False)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class StateCollector(Collector):
    """The gauges and counters read when scraped (see the module doc)."""

    def __init__(self, app: Any):
        self.app = app

    def collect(self) -> Iterator[Metric]:
        """Yield the job and reconciler families (read now, from the database and the reconciler)."""
        with Session(self.app.state.engine) as s:
            counts, running = operations.job_counts(s), operations.running_jobs(s)
        jobs = GaugeMetricFamily("sft_jobs", "Fine-tuning jobs by tenant, state and phase",
                                 labels=["tenant", "status", "phase"])
        for tenant, status, phase, n in counts:
            jobs.add_metric([tenant, status, phase], n)
        yield jobs
        for name, doc, attr in (("sft_job_tokens_per_second", "A running job's last reported tokens/s", "tokens_per_s"),
                                ("sft_job_step_age_seconds", "Seconds since a running job's last line", "step_age_s"),
                                ("sft_job_checkpoint_age_seconds", "Seconds since a running job's newest checkpoint",
                                 "checkpoint_age_s")):
            family = GaugeMetricFamily(name, doc, labels=["tenant", "job"])
            for r in running:
                value = getattr(r, attr)
                if value is not None:
                    family.add_metric([r.tenant, r.job_id], value)
            yield family
        rec = self.app.state.reconciler
        if rec is None:
            return
        cycles = CounterMetricFamily("sft_reconcile_cycles", "Reconcile cycles run, by outcome", labels=["outcome"])
        stats = rec.stats
        cycles.add_metric(["ok"], stats.cycles - sum(stats.failed.values()))
        for cause, n in sorted(stats.failed.items()):
            cycles.add_metric([f"failed_{cause}"], n)
        yield cycles
        yield CounterMetricFamily("sft_reconcile_seconds", "Seconds spent in reconcile cycles", value=stats.seconds)
        yield GaugeMetricFamily("sft_reconcile_last_cycle_seconds", "The last reconcile cycle's seconds",
                                value=stats.last_seconds)
        recent = GaugeMetricFamily("sft_reconcile_cycle_seconds_quantile", "Quantiles of the latest reconcile "
                                   "cycles' seconds (at most 4096 cycles)", labels=["quantile"])
        for q, v in stats.quantiles().items():
            recent.add_metric([f"{q:g}"], v)
        yield recent
        missed = CounterMetricFamily(
            "sft_reconcile_storage_missed", "Tenants' storage calls that gave a reconcile cycle no answer, by "
            "verb and outcome: error, late (the cycle stopped waiting; the tenant is read later), skipped (not "
            "made: the tenant's previous call still ran, or it pauses after a failure)", labels=["verb", "outcome"])
        for (verb, outcome), n in sorted(dict(stats.storage_missed).items()):
            missed.add_metric([verb, outcome], n)
        yield missed
        yield CounterMetricFamily(
            "sft_reconcile_record_alerts", "Slurm records a cycle did not act on: another user's or account's "
            "job under a recorded id, or records that did not parse or repeated an id", value=rec.alerts)
        yield GaugeMetricFamily("sft_reconciler_leader", "1 while this process holds the reconciler lease",
                                value=1.0 if rec.lease.held else 0.0)
        yield CounterMetricFamily("sft_reconciler_lease_takeovers", "Times this process took the reconciler lease",
                                  value=rec.lease.takeovers)
        sweeper = rec.sweeper
        gone = CounterMetricFamily("sft_retention_deleted", "Deletions by this process's retention sweeper, by what: "
                                   "file, prune (a succeeded job's training state), checkpoints, logs", labels=["what"])
        for what, n in sorted(dict(sweeper.deleted).items()):
            gone.add_metric([what], n)
        yield gone
        yield CounterMetricFamily("sft_retention_freed_bytes", "Bytes this process's retention sweeper freed",
                                  value=sweeper.freed_bytes)
        yield GaugeMetricFamily("sft_retention_last_pass_seconds", "The last retention sweep pass's seconds (in a "
                                "thread of its own, not in a cycle)",
                                value=sweeper.last.seconds if sweeper.last else 0.0)
        found = CounterMetricFamily("sft_detector_findings", "Detector findings raised, by rule", labels=["rule"])
        for rule, n in sorted(dict(rec.detector_counts).items()):
            found.add_metric([rule], n)
        yield found


class RequestMetrics:
    """ASGI middleware: count and time each HTTP request by method, route template and status."""

    def __init__(self, app: Any, registry: CollectorRegistry):
        self.app = app
        self.requests = Counter("sft_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=registry)
        self.latency = Histogram("sft_http_request_seconds", "HTTP request latency", ["method", "route"],
                                 registry=registry, buckets=BUCKETS)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on; observe its status and seconds once it is answered."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), [500]

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"   # never the raw path: ids are unbounded
            self.requests.labels(scope["method"], template, str(status[0])).inc()
            self.latency.labels(scope["method"], template).observe(time.perf_counter() - t0)


def install(app: Any) -> None:
    """Give ``app`` its registry, the request middleware and the scrape-time collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(app))
    app.state.metrics = registry
    app.add_middleware(RequestMetrics, registry=registry)


@router.get("/metrics", dependencies=[access(Policy.SYSADMIN)])
def metrics(request: Request) -> Response:
    """Every metric of this gateway, in the Prometheus text format."""
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)
