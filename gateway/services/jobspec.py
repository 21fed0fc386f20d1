"""A job's hyperparameters and the trainer's spec: the epochs the estimate needs, the spec
written to the job dir and the check of one read back. Hyperparameters arrive with our names
(``gateway.api.openai`` translates OpenAI's); their defaults and ranges are the contract's.

Creation and recovery build the spec the same way (``job_spec``), so a resubmitted
job trains exactly as its first attempt did.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.models import DataFile, FineTuningJob
from gateway.services.files import file_parts
from gateway.storage import layout
from trainer.contract.errors import SpecError
from trainer.contract.spec import HYPERPARAMETER_BOUNDS, HYPERPARAMETER_DEFAULTS, JobSpec, parse_spec

if TYPE_CHECKING:
    from trainer.catalog import CatalogEntry


AUTO = "auto"
"""The key of a job's recorded hyperparameters that keeps what ``auto`` chose (``autohp.Choice.record``):
the gateway's, never the trainer's (``job_spec`` leaves it out of the spec)."""
NOT_TRAINER_HYPERPARAMETERS = ("checkpoint_every_steps", "keep_checkpoints", AUTO)
"""Keys of a job's recorded hyperparameters that are not the spec's ``hyperparameters``."""


def whole_epochs(value: Any, param: str = "hyperparameters.epochs") -> int:
    """``value`` as a whole number of epochs in the contract's range; ServiceError (400) naming
    ``param`` otherwise (the estimate needs it before the full spec is checked)."""
    bounds = HYPERPARAMETER_BOUNDS["epochs"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value != int(value) or not bounds.contains(value):
        raise ServiceError(f"{param} must be a whole number from {bounds.low} to {bounds.high}", param=param)
    return int(value)


def _epochs(hp: dict[str, Any]) -> int:
    """The number of epochs of our hyperparameters ``hp`` (the contract's default when not given)."""
    return whole_epochs(hp.get("epochs", HYPERPARAMETER_DEFAULTS["epochs"]))


def job_dir(settings: Settings, tenant: str, job_id: str) -> str:
    """The job dir's absolute path, as the trainer (running as the tenant) sees it."""
    return layout.absolute(settings.storage_root, tenant, layout.job(job_id))


def job_spec(settings: Settings, tenant: str, job: FineTuningJob, train: DataFile,
             val: DataFile | None, entry: CatalogEntry, init: DataFile | None = None) -> JobSpec:
    """The trainer's spec for ``job`` of ``tenant``, typed (creation and recovery build it the
    same way); ``init``: the parent's adapter tar (continued training). ServiceError
    naming the field if it is invalid."""
    hp = dict(job.hyperparameters or {})
    top = {k: hp.pop(k) for k in NOT_TRAINER_HYPERPARAMETERS if k in hp}
    spec: dict[str, Any] = {
        "job_id": job.id,
        "base_model": {"name": job.model, "digest": entry.digest, "catalog_root": str(settings.models_root)},
        "train": {"path": layout.absolute(settings.storage_root, tenant, file_parts(train)),
                  "sha256": train.sha256},
        "validation": ({"path": layout.absolute(settings.storage_root, tenant, file_parts(val)),
                        "sha256": val.sha256} if val else None),
        "hyperparameters": hp,
        "job_dir": job_dir(settings, tenant, job.id),
        "checkpoint_every_steps": top.get("checkpoint_every_steps", settings.checkpoint_every_steps),
        **({"keep_checkpoints": top["keep_checkpoints"]} if "keep_checkpoints" in top else {}),
        **({"device": settings.job_device} if settings.job_device != "auto" else {}),
        **({"world_size": job.gpus} if job.gpus > 1 else {}),
        **({"fsdp": True} if job.fsdp else {}),
        **({"init_adapter": {"path": layout.absolute(settings.storage_root, tenant, file_parts(init)),
                             "sha256": init.sha256}} if init is not None else {}),
        **({"method": job.method} if job.method != "supervised" else {}),
    }
    try:
        return parse_spec(spec)    # typed from here on: the broker writes exactly this (spec_file_text)
    except SpecError as e:
        raise ServiceError(f"invalid hyperparameters: {e}", param="hyperparameters") from e


def saved_spec_matches(saved: bytes | None, expected: JobSpec) -> bool:
    """Whether a spec.json read back from tenant storage (untrusted: the tenant can rewrite it) is
    the spec the gateway would write now: parsed and validated, then compared field by field."""
    if saved is None or len(saved) > 1 << 20:
        return False
    try:
        spec = json.loads(saved)
        if not isinstance(spec, dict):
            return False
        return parse_spec(spec) == expected
    except (ValueError, SpecError, TypeError):
        return False
