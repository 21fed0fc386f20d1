"""A job's ``integrations`` (OpenAI's field): which a site supports, their checks, and what is kept.

One kind today, MLflow: ``{"type": "mlflow", "mlflow": {"tracking_uri": "https://host[:port][/path]",
"experiment": "...", "run_name": "...", "token": "..."}}`` (or ``"username"`` and ``"password"``
instead of ``token``). The gateway, not the job, logs to that server (``services.mlflowlog``): a job
may run where there is no network, and the job's events are the gateway's already.

At create (``parse``), before anything is recorded, each entry is checked, a refusal naming it
(``integrations[0].mlflow.tracking_uri``): http(s) without credentials in the URL, every address
public unless the host is in the site's ``mlflow_allowed_hosts`` (the webhooks' rules,
``services.netguard``; the worker dials exactly the addresses it checked, again at each pass).
``attach`` records the job's view (``public``: never a credential) and one ``MlflowRun`` row with the
credentials sealed (``services.secretbox``). ``redacted`` is what the request hash sees: the
credentials' names, not their values.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session

from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.models import FineTuningJob, MlflowParentRun, MlflowRun, Sweep
from gateway.services import netguard, secretbox

log = logging.getLogger(__name__)

KINDS = ("mlflow",)
SECRET_FIELDS = ("token", "username", "password")
FIELDS = ("tracking_uri", "experiment", "run_name", *SECRET_FIELDS)
LIMITS = {"tracking_uri": 2000, "experiment": 500, "run_name": 250, "token": 4096, "username": 256,
          "password": 4096}


@dataclass(frozen=True)
class MlflowIntegration:
    """One checked ``mlflow`` entry; ``secrets`` holds ``token`` or ``username``/``password`` (or nothing)."""

    tracking_uri: str
    experiment: str
    run_name: str | None
    secrets: dict[str, str]

    def public(self) -> dict[str, Any]:
        """The entry as the job object shows it: the server, experiment and run name, never a credential."""
        auth = "token" if "token" in self.secrets else "basic" if self.secrets else None
        return {"type": "mlflow", "mlflow": {"tracking_uri": self.tracking_uri, "experiment": self.experiment,
                                             "run_name": self.run_name, "auth": auth}}


def target(url: str, param: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL without credentials, query or fragment; ServiceError naming ``param``."""
    target = netguard.http_target(url)
    if target is None or target[0].query or target[0].fragment:
        raise ServiceError(f"{param} must be http(s)://host[:port][/path], without credentials (give them as "
                           "token, or username and password, beside it)", param=param)
    return target[1], target[2]


def dial_addresses(url: str, settings: Settings, param: str = "tracking_uri") -> list[netguard.IPAddress]:
    """The addresses to connect to for ``url``, resolved once: each public, or any for a host in
    ``mlflow_allowed_hosts``; ServiceError naming ``param`` (and the host, never its addresses) otherwise."""
    host, port = target(url, param)
    try:
        if host in settings.mlflow_allowed_hosts:
            return netguard.resolve(host, port)
        return netguard.public_addresses(host, port)
    except netguard.NotPublic as e:
        log.warning("mlflow tracking uri refused: %s", e)       # the address, for the site only
        raise ServiceError(f"{param}: {host} is not a public address (or does not resolve); this site logs to "
                           "tracking servers whose every address is public, unless its administrator allows the "
                           "host", param=param) from None


def _text(entry: dict[str, Any], name: str, where: str, *, required: bool) -> str | None:
    value = entry.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > LIMITS[name]:
        raise ServiceError(f"{where}.{name} must be a non-empty string of at most {LIMITS[name]} characters",
                           param=f"{where}.{name}")
    return value


def _one(raw: Any, i: int, settings: Settings) -> MlflowIntegration:
    where = f"integrations[{i}]"
    if not isinstance(raw, dict) or raw.get("type") not in KINDS:
        kind = raw.get("type") if isinstance(raw, dict) else None
        raise ServiceError(f"{where}.type {kind!r} is not supported here: the supported types are "
                           f"{', '.join(KINDS)}", param=f"{where}.type")
    unknown = sorted(set(raw) - {"type", "mlflow"})
    entry = raw.get("mlflow")
    if unknown or not isinstance(entry, dict):
        raise ServiceError(f"{where} takes type and mlflow (an object){f', not {unknown}' if unknown else ''}",
                           param=f"{where}.mlflow")
    where += ".mlflow"
    unknown = sorted(set(entry) - set(FIELDS))
    if unknown:
        raise ServiceError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(FIELDS)}",
                           param=f"{where}.{unknown[0]}")
    uri = _text(entry, "tracking_uri", where, required=True)
    experiment = _text(entry, "experiment", where, required=True)
    assert uri is not None and experiment is not None
    secrets = {k: v for k in SECRET_FIELDS if (v := _text(entry, k, where, required=False)) is not None}
    if "token" in secrets and len(secrets) > 1 or ("username" in secrets) != ("password" in secrets):
        raise ServiceError(f"{where}: give token, or username and password, not both", param=f"{where}.token")
    dial_addresses(uri, settings, f"{where}.tracking_uri")
    return MlflowIntegration(tracking_uri=uri.rstrip("/"), experiment=experiment,
                             run_name=_text(entry, "run_name", where, required=False), secrets=secrets)


def parse(raw: list[Any] | None, settings: Settings) -> list[MlflowIntegration]:
    """The request's ``integrations`` checked (see the module doc); ServiceError (400) naming the entry and
    field (``integrations[0].mlflow.tracking_uri``) for the first that is wrong."""
    found = [_one(entry, i, settings) for i, entry in enumerate(raw or [])]
    if len(found) > 1:
        raise ServiceError("integrations: at most one mlflow integration per job", param="integrations[1]")
    return found


def redacted(raw: list[Any] | None) -> list[Any] | None:
    """``raw`` with each credential's value replaced by ``"***"`` (for the request hash: a retry with the same
    body matches, and no digest of a password is stored)."""
    if raw is None:
        return None

    def hide(entry: Any) -> Any:
        if isinstance(entry, dict) and isinstance(entry.get("mlflow"), dict):
            return {**entry, "mlflow": {k: "***" if k in SECRET_FIELDS else v for k, v in entry["mlflow"].items()}}
        return entry

    return [hide(e) for e in raw]


def _sealed(it: MlflowIntegration, settings: Settings) -> str | None:
    """The entry's credentials sealed with the site's key (None without); ServiceError when the key is unusable."""
    try:
        return secretbox.seal(settings.integration_key_file, json.dumps(it.secrets)) if it.secrets else None
    except secretbox.Unavailable as e:
        log.error("integration credentials cannot be sealed: %s", e)
        raise ServiceError("this gateway cannot store integration credentials now (its key file is unusable): "
                           "try without them, or ask the site's administrator", code="integration_unavailable",
                           param="integrations[0].mlflow") from e


def attach(session: Session, job: FineTuningJob, integrations: list[MlflowIntegration], settings: Settings) -> None:
    """In the caller's transaction, after the job's row is flushed: one ``MlflowRun`` per integration (its
    credentials sealed with the site's key). ServiceError (``integration_unavailable``) when the key file
    cannot be used."""
    for it in integrations:
        session.add(MlflowRun(job_id=job.id, tenant_id=job.tenant_id, tracking_uri=it.tracking_uri,
                              experiment=it.experiment, run_name=it.run_name, credentials=_sealed(it, settings)))


def run_name_of(it: MlflowIntegration, sweep: Sweep, task: int) -> str:
    """A sweep's run ``task``'s run name: the parent's (the integration's, else the sweep id) and the task."""
    return f"{it.run_name or sweep.id}-{task}"


def attach_sweep(session: Session, sweep: Sweep, jobs: list[FineTuningJob], integrations: list[MlflowIntegration],
                 settings: Settings) -> None:
    """In the caller's transaction, after the sweep's and its jobs' rows are flushed: per integration, the
    sweep's parent run (``MlflowParentRun``) and one child ``MlflowRun`` per job, in task order (each named
    ``run_name_of``). ServiceError (``integration_unavailable``) as ``attach``."""
    for it in integrations:
        sealed = _sealed(it, settings)
        session.add(MlflowParentRun(sweep_id=sweep.id, tenant_id=sweep.tenant_id, tracking_uri=it.tracking_uri,
                                    experiment=it.experiment, run_name=it.run_name or sweep.id, credentials=sealed))
        session.flush()
        for task, job in enumerate(jobs):
            session.add(MlflowRun(job_id=job.id, tenant_id=job.tenant_id, tracking_uri=it.tracking_uri,
                                  experiment=it.experiment, run_name=run_name_of(it, sweep, task),
                                  credentials=sealed, sweep_id=sweep.id))


def credentials(run: MlflowRun | MlflowParentRun, settings: Settings) -> dict[str, str]:
    """The run's credentials, unsealed (empty without); secretbox.Unavailable when the key cannot open them."""
    if not run.credentials:
        return {}
    found = json.loads(secretbox.unseal(settings.integration_key_file, run.credentials))
    return {k: str(v) for k, v in found.items() if k in SECRET_FIELDS}
