"""The gateway's MLflow logger: each job with an MLflow integration (``services.tracking``) logged to
its tenant's tracking server over MLflow's REST API (httpx; no mlflow package in the gateway).

``log_due`` (run by the reconciler's process in a thread of its own, ``jobs.workers``) advances every
due ``MlflowRun`` as far as it can, in this order, each step recorded once it succeeded:

1. the experiment (``experiments/get-by-name``, else ``experiments/create``) and the run
   (``runs/create``: the run name, the job's creation time, tags ``slurm_finetune.job_id`` and, when the
   site has a public URL, ``slurm_finetune.url``, the job's portal page);
2. the parameters (``runs/log-batch``): the job id, model, files, method, resources and every
   hyperparameter;
3. the job's metrics events after ``event_cursor`` (each step's ``train_loss``, ``lr``, ``tokens_per_s``,
   ...; each eval's ``valid_*``, the final eval's ``final_valid_*``), in batches (``runs/log-batch`` with
   each point's own step and the time the gateway read it), moving the cursor past each batch once the
   server took it;
4. once the job has ended and every event is logged: ``trained_tokens``, a ``slurm_finetune.status`` tag,
   and the run's status (FINISHED, FAILED or KILLED, ``state.MLFLOW_END``) with the job's end time
   (``runs/update``).

A server that is down, slow or refusing costs the run a back-off (``mlflow_retry_base_s`` x 2^(n-1), at
most ``mlflow_max_backoff_s``); when it answers again the history is logged point for point from the
cursor. A sweep's jobs log child runs (tag ``mlflow.parentRunId``) of the sweep's parent run
(``MlflowParentRun``: made by its first child to reach the server, with the grid as params), which ends
once every child has (FINISHED when every job succeeded, ``sweep_status``) with the best final
validation loss. After ``mlflow_max_attempts`` failures in a row the run is given up (``TrackingState.FAILED``,
its last error kept). The tracking URI is checked again at each pass and dialled at exactly the checked
addresses (``netguard.PinnedTransport``). A pass with nothing new writes nothing to the database.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from datetime import timedelta
from typing import Any

import httpx
from sqlmodel import Session, col, select

from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.models import FineTuningJob, JobEvent, MlflowParentRun, MlflowRun, Sweep, utcnow
from gateway.services import netguard, secretbox, tracking
from gateway.state import MLFLOW_END, TERMINAL, JobState, MlflowRunStatus, TrackingState
from gateway.storage.verbs import tenant_json

log = logging.getLogger(__name__)

API = "/api/2.0/mlflow/"
EVENTS_PER_BATCH = 150      # a step event carries a handful of metrics: MLflow takes 1000 a request
MAX_BATCHES_PER_PASS = 20   # one run's backlog never holds up the others for long
PARAM_CHARS = 6000          # MLflow's longest parameter value
NOT_METRICS = frozenset({"step", "total_steps", "when"})


class MlflowError(Exception):
    """The tracking server answered with an error (its HTTP status and MLflow's ``error_code``)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"HTTP {status} {code}: {message[:150]}")
        self.status, self.code = status, code


Transport = httpx.BaseTransport
MAX_ANSWER_BYTES = 1024 * 1024      # MLflow's answers to these calls are a few hundred bytes
SERVER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def server_id(value: Any) -> str:
    """An experiment or run id as the tenant's server gave it, if it is one (1-64 of ``[A-Za-z0-9_-]``, what
    MLflow makes); MlflowError otherwise: it is stored and sent back, so it is checked like any tenant input."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not SERVER_ID.fullmatch(value):
        raise MlflowError(200, "BAD_ANSWER", "the server answered an id that is not an MLflow id")
    return value


class Client:
    """MLflow's REST calls for one run's server, with its credentials; ``transport``: the pinned one (tests
    pass their own)."""

    def __init__(self, uri: str, secrets: dict[str, str], settings: Settings, transport: Transport):
        auth: httpx.Auth | None = None
        headers = {"user-agent": "slurm-finetune-mlflow"}
        if "token" in secrets:
            headers["authorization"] = f"Bearer {secrets['token']}"
        elif "username" in secrets:
            auth = httpx.BasicAuth(secrets["username"], secrets["password"])
        self.base, self.timeout = uri.rstrip("/") + API, settings.mlflow_timeout_s
        self.http = httpx.Client(transport=transport, timeout=settings.mlflow_timeout_s, follow_redirects=False,
                                 trust_env=False, headers=headers, auth=auth)

    def close(self) -> None:
        """Close the connection."""
        self.http.close()

    def call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        """The JSON answer of ``method path``; MlflowError for an error answer or one over ``MAX_ANSWER_BYTES``
        or ``timeout`` x 3 in all (the server is the tenant's: it may drip or flood), httpx.HTTPError for none."""
        deadline = time.monotonic() + 3 * self.timeout
        with self.http.stream(method, self.base + path, **kw) as r:
            raw = bytearray()
            for chunk in r.iter_bytes():
                raw += chunk
                if len(raw) > MAX_ANSWER_BYTES or time.monotonic() > deadline:
                    raise MlflowError(r.status_code, "ANSWER_REFUSED", f"over {MAX_ANSWER_BYTES} bytes or "
                                      f"{3 * self.timeout:.0f}s: not read further")
        try:
            body = tenant_json(bytes(raw), "mlflow answer") if raw else {}
        except ValueError:
            if r.is_success:
                raise MlflowError(r.status_code, "BAD_ANSWER", "the answer is not JSON") from None
            body = {}
        if not r.is_success:
            body = body if isinstance(body, dict) else {}
            raise MlflowError(r.status_code, str(body.get("error_code") or "HTTP_ERROR"),
                              str(body.get("message") or r.reason_phrase))
        return body if isinstance(body, dict) else {}

    def experiment_id(self, name: str) -> str:
        """The id of experiment ``name``, created when there is none."""
        try:
            return server_id(self.call("GET", "experiments/get-by-name",
                                       params={"experiment_name": name})["experiment"]["experiment_id"])
        except MlflowError as e:
            if e.code != "RESOURCE_DOES_NOT_EXIST":
                raise
        try:
            return server_id(self.call("POST", "experiments/create", json={"name": name})["experiment_id"])
        except MlflowError as e:
            if e.code != "RESOURCE_ALREADY_EXISTS":      # another job made it just now
                raise
            return self.experiment_id(name)

    def log_batch(self, run_id: str, *, metrics: list[dict[str, Any]] | None = None,
                  params: list[dict[str, str]] | None = None, tags: list[dict[str, str]] | None = None) -> None:
        """One ``runs/log-batch`` (the caller keeps to MLflow's 1000 metrics, 100 params and 100 tags)."""
        self.call("POST", "runs/log-batch", json={"run_id": run_id, "metrics": metrics or [],
                                                  "params": params or [], "tags": tags or []})


def _ms(dt: Any) -> int:
    return int(dt.timestamp() * 1000)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def event_metrics(ev: JobEvent) -> list[dict[str, Any]]:
    """The MLflow metrics of one job event: each numeric field of a ``metrics`` event's data but its step
    (``train_loss``, ``lr``, ``valid_loss``, ...), at that step and the time the gateway read it; the final
    eval's (``when: after``) as ``final_valid_*``: it often repeats the last step's eval in the same
    millisecond, and MLflow keeps one of two equal points."""
    data = ev.data or {}
    step = data.get("step") if isinstance(data.get("step"), int) and not isinstance(data.get("step"), bool) else 0
    prefix = "final_" if data.get("when") == "after" else ""
    return [{"key": prefix + k, "value": v, "timestamp": _ms(ev.created_at), "step": step}
            for k, raw in data.items() if k not in NOT_METRICS and (v := _num(raw)) is not None]


def params_of(job: FineTuningJob) -> list[dict[str, str]]:
    """The run's parameters: the job's identity, model, files, method, resources and hyperparameters."""
    fields: dict[str, Any] = {"job_id": job.id, "model": job.parent_model or job.model, "base_model": job.model,
                              "training_file": job.training_file, "validation_file": job.validation_file,
                              "method": job.method, "suffix": job.suffix, "seed": job.seed, "gpus": job.gpus,
                              "nodes": job.nodes}
    fields.update({f"hp.{k}": v for k, v in sorted((job.hyperparameters or {}).items())})
    return [{"key": k, "value": str(v)[:PARAM_CHARS]} for k, v in fields.items() if v is not None][:100]


def run_tags(job: FineTuningJob, settings: Settings) -> list[dict[str, str]]:
    """Tags linking the run back to the job: its id and, with a public URL, its portal page."""
    tags = [{"key": "slurm_finetune.job_id", "value": job.id}]
    if settings.public_urls:
        base = settings.public_urls[0].rstrip("/")
        tags.append({"key": "slurm_finetune.url", "value": f"{base}/portal/jobs/{job.id}"})
    return tags


def final_metrics(job: FineTuningJob) -> list[dict[str, Any]]:
    """What the ended job adds to its events' metrics: its trained tokens, at its last step."""
    if job.trained_tokens is None:
        return []
    return [{"key": "trained_tokens", "value": float(job.trained_tokens), "timestamp": _ms(job.finished_at or utcnow()),
             "step": int(_num((job.progress or {}).get("step")) or 0)}]


def final_valid_loss(job: FineTuningJob) -> float | None:
    """The job's final validation loss (its ``after`` eval), or None."""
    evals = [e for e in (job.progress or {}).get("evals") or [] if isinstance(e, dict) and e.get("when") == "after"]
    return _num(evals[-1].get("loss")) if evals else None


def backoff_s(attempts: int, settings: Settings) -> float:
    """The wait after the ``attempts``-th failure in a row: base x 2^(n-1), at most the maximum."""
    return float(min(settings.mlflow_max_backoff_s, settings.mlflow_retry_base_s * 2 ** min(attempts - 1, 30)))


def sweep_params(sweep: Sweep) -> list[dict[str, str]]:
    """A sweep's parent run's parameters: the sweep, its model, files and grid (``grid.<name>``: the values)."""
    fields: dict[str, Any] = {"sweep_id": sweep.id, "model": sweep.model, "runs": len(sweep.job_ids),
                              **{f"grid.{k}": json.dumps(v) for k, v in sweep.grid.items()}}
    return [{"key": k, "value": str(v)[:PARAM_CHARS]} for k, v in fields.items()][:100]


def _parent(s: Session, run: MlflowRun, client: Client) -> MlflowParentRun | None:
    """The parent run of a sweep's job's run, created (experiment, run, params) when it is not yet; None for
    a job of no sweep."""
    parent = s.get(MlflowParentRun, run.sweep_id) if run.sweep_id else None
    sweep = s.get(Sweep, run.sweep_id) if run.sweep_id else None
    if parent is None or sweep is None or parent.run_id is not None:
        return parent
    if parent.experiment_id is None:
        parent.experiment_id = client.experiment_id(parent.experiment)
    tags = [{"key": "slurm_finetune.sweep_id", "value": sweep.id}]
    parent.run_id = server_id(client.call("POST", "runs/create", json={
        "experiment_id": parent.experiment_id, "start_time": _ms(sweep.created_at), "run_name": parent.run_name,
        "tags": tags})["run"]["info"]["run_id"])
    _save(s, parent)
    client.log_batch(parent.run_id, params=sweep_params(sweep))
    return parent


def _advance(s: Session, run: MlflowRun, job: FineTuningJob, client: Client, settings: Settings) -> bool:
    """Log what is due for ``run``, committing after each step the server took; whether the run is done."""
    if run.run_id is None:
        parent = _parent(s, run, client)
        if run.experiment_id is None:
            run.experiment_id = parent.experiment_id if parent else client.experiment_id(run.experiment)
        tags = run_tags(job, settings)
        if parent is not None:
            tags.append({"key": "mlflow.parentRunId", "value": str(parent.run_id)})
        body = {"experiment_id": run.experiment_id, "start_time": _ms(job.created_at), "tags": tags}
        if run.run_name:
            body["run_name"] = run.run_name
        run.run_id = server_id(client.call("POST", "runs/create", json=body)["run"]["info"]["run_id"])
        _save(s, run)
    assert run.run_id is not None
    if not run.params_logged:
        client.log_batch(run.run_id, params=params_of(job))
        run.params_logged = True
        _save(s, run)
    ended = JobState(job.status) in TERMINAL     # read before the events: none come after the end
    for _ in range(MAX_BATCHES_PER_PASS):
        events = list(s.exec(select(JobEvent).where(JobEvent.job_id == job.id, JobEvent.type == "metrics",
                                                    col(JobEvent.id) > run.event_cursor)
                             .order_by(col(JobEvent.id)).limit(EVENTS_PER_BATCH)))
        if not events:
            break
        metrics = [m for ev in events for m in event_metrics(ev)]
        for i in range(0, len(metrics), 1000):
            client.log_batch(run.run_id, metrics=metrics[i:i + 1000])
        assert events[-1].id is not None
        run.event_cursor = events[-1].id
        _save(s, run)
    else:
        return False          # more to log: the next pass goes on
    if not ended:
        return False
    client.log_batch(run.run_id, metrics=final_metrics(job),
                     tags=[{"key": "slurm_finetune.status", "value": job.status}])
    client.call("POST", "runs/update", json={"run_id": run.run_id, "status": MLFLOW_END[JobState(job.status)].value,
                                             "end_time": _ms(job.finished_at or utcnow())})
    return True


def _save(s: Session, run: MlflowRun | MlflowParentRun) -> None:
    run.attempts, run.last_error = 0, None
    s.add(run)
    s.commit()


def _fail(s: Session, run: MlflowRun | MlflowParentRun, error: str, settings: Settings) -> None:
    of = run.job_id if isinstance(run, MlflowRun) else run.sweep_id
    run.attempts += 1
    run.last_error = error[:300]
    if run.attempts >= settings.mlflow_max_attempts:
        run.status, run.finished_at = TrackingState.FAILED, utcnow()
        log.warning("mlflow run of %s given up after %d failures: %s", of, run.attempts, error)
    else:
        run.next_at = utcnow() + timedelta(seconds=backoff_s(run.attempts, settings))
        log.info("mlflow run of %s: %s; retrying in %.0fs", of, error, backoff_s(run.attempts, settings))
    s.add(run)
    s.commit()


def _transport(run: MlflowRun | MlflowParentRun, settings: Settings) -> Transport:
    return netguard.PinnedTransport(tracking.dial_addresses(run.tracking_uri, settings))


def _idle(s: Session, run: MlflowRun, job: FineTuningJob) -> bool:
    """Whether ``run`` has nothing to log now: created, params logged, its job still going, no new event."""
    if run.run_id is None or not run.params_logged or JobState(job.status) in TERMINAL:
        return False
    return s.exec(select(JobEvent.id).where(JobEvent.job_id == job.id, JobEvent.type == "metrics",
                                            col(JobEvent.id) > run.event_cursor).limit(1)).first() is None


def log_due(engine: Any, settings: Settings, *, transport: Transport | None = None) -> int:
    """Advance every due MLflow run (see the module doc; each by at most ``MAX_BATCHES_PER_PASS`` batches, so
    every run gets its turn each pass); returns how many it completed. A run with nothing new costs one
    query: no connection, no DNS lookup. ``transport`` replaces the pinned connection to each server (tests)."""
    done = 0
    with Session(engine, expire_on_commit=False) as s:
        due = list(s.exec(select(MlflowRun).where(MlflowRun.status == TrackingState.LOGGING,
                                                  col(MlflowRun.next_at) <= utcnow())
                          .order_by(col(MlflowRun.next_at))))
        for run in due:
            job = s.get(FineTuningJob, run.job_id)
            if job is None or _idle(s, run, job):
                continue
            try:
                client = Client(run.tracking_uri, tracking.credentials(run, settings), settings,
                                transport or _transport(run, settings))
                try:
                    finished = _advance(s, run, job, client, settings)
                finally:
                    client.close()
            except (httpx.HTTPError, MlflowError, ServiceError, secretbox.Unavailable, KeyError, TypeError) as e:
                _fail(s, run, f"{type(e).__name__}: {e}", settings)
                continue
            except Exception as e:       # one tenant's server never stops the pass for the others' runs
                s.rollback()
                log.exception("mlflow run of %s failed", run.job_id)
                _fail(s, run, f"internal error ({type(e).__name__})", settings)
                continue
            if finished:
                run.status, run.finished_at = TrackingState.DONE, utcnow()
                _save(s, run)
                done += 1
                log.info("mlflow run %s of %s completed (%s)", run.run_id, job.id, job.status)
        done += _end_parents(s, settings, transport)
    return done


def sweep_status(states: list[str]) -> MlflowRunStatus:
    """A sweep's parent run's end: FINISHED when every run succeeded, KILLED when the others were cancelled,
    else FAILED."""
    if all(st == JobState.SUCCEEDED for st in states):
        return MlflowRunStatus.FINISHED
    if all(st in (JobState.SUCCEEDED, JobState.CANCELLED) for st in states):
        return MlflowRunStatus.KILLED
    return MlflowRunStatus.FAILED


def _end_parents(s: Session, settings: Settings, transport: Transport | None) -> int:
    """End each due parent run whose children are all logged (or given up): its best final validation loss
    and the sweep's status; returns how many it ended."""
    done = 0
    for parent in s.exec(select(MlflowParentRun).where(MlflowParentRun.status == TrackingState.LOGGING,
                                                       col(MlflowParentRun.next_at) <= utcnow())).all():
        children = list(s.exec(select(MlflowRun).where(MlflowRun.sweep_id == parent.sweep_id)))
        if any(c.status == TrackingState.LOGGING for c in children):
            continue
        if parent.run_id is None:          # no child ever reached the server: nothing to end there
            parent.status, parent.finished_at, parent.last_error = TrackingState.FAILED, utcnow(), "no run logged"
            _save(s, parent)
            continue
        jobs = [j for c in children if (j := s.get(FineTuningJob, c.job_id)) is not None]
        losses = [loss for j in jobs if j.status == JobState.SUCCEEDED and (loss := final_valid_loss(j)) is not None]
        ended = max((j.finished_at for j in jobs if j.finished_at), default=utcnow())
        try:
            client = Client(parent.tracking_uri, tracking.credentials(parent, settings), settings,
                            transport or _transport(parent, settings))
            try:
                if losses:
                    client.log_batch(parent.run_id, metrics=[{"key": "best_valid_loss", "value": min(losses),
                                                              "timestamp": _ms(ended), "step": 0}])
                client.call("POST", "runs/update", json={"run_id": parent.run_id, "end_time": _ms(ended),
                                                         "status": sweep_status([j.status for j in jobs]).value})
            finally:
                client.close()
        except (httpx.HTTPError, MlflowError, ServiceError, secretbox.Unavailable, KeyError, TypeError) as e:
            _fail(s, parent, f"{type(e).__name__}: {e}", settings)
            continue
        except Exception as e:           # as for a job's run: never the end of the pass
            s.rollback()
            log.exception("mlflow parent run of %s failed", parent.sweep_id)
            _fail(s, parent, f"internal error ({type(e).__name__})", settings)
            continue
        parent.status, parent.finished_at = TrackingState.DONE, utcnow()
        _save(s, parent)
        done += 1
    return done
