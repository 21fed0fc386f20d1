"""A job's hyperparameters and the trainer's spec: OpenAI's names to ours, the
defaults the API shows, the spec written to the job dir and the check of one read back.

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
from gateway.storage import layout

if TYPE_CHECKING:
    from trainer.catalog import CatalogEntry


# OpenAI's hyperparameter names → ours; ours are accepted as they are.
OPENAI_HP = {"n_epochs": "epochs", "learning_rate_multiplier": "learning_rate_multiplier",
             "batch_size": "batch_size"}
BASE_LEARNING_RATE = 2e-4
DEFAULT_EPOCHS = 3
DEFAULT_BETA = 0.1     # DPO's (trainer.spec.Hyperparameters.beta; TRL's and OpenAI's default)
MAX_EPOCHS = 100   # trainer.spec.Hyperparameters.epochs


def _epochs(hp: dict[str, Any]) -> int:
    """The number of epochs the estimate needs; ServiceError (400) naming the field when it
    is not a whole number in the trainer's range (the full spec is checked later)."""
    value = hp.get("epochs", DEFAULT_EPOCHS)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value != int(value) or not 1 <= value <= MAX_EPOCHS:
        raise ServiceError(f"hyperparameters.n_epochs must be a whole number from 1 to {MAX_EPOCHS}",
                           param="hyperparameters.n_epochs")
    return int(value)


def build_hyperparameters(raw: dict[str, Any]) -> dict[str, Any]:
    """OpenAI-style (n_epochs, learning_rate_multiplier, batch_size) or native names → ours."""
    hp = {k: v for k, v in raw.items() if v != "auto"}
    if "n_epochs" in hp:
        hp["epochs"] = hp.pop("n_epochs")
    if "learning_rate_multiplier" in hp:
        mult = hp.pop("learning_rate_multiplier")
        if not isinstance(mult, int | float) or isinstance(mult, bool) or mult <= 0:
            raise ServiceError("learning_rate_multiplier must be a positive number",
                               param="hyperparameters.learning_rate_multiplier")
        hp["learning_rate"] = BASE_LEARNING_RATE * mult
    hp.pop("batch_size", None)  # examples per batch: we pack by tokens (batch_size_tokens)
    return hp


def job_dir(settings: Settings, tenant: str, job_id: str) -> str:
    """The job dir's absolute path, as the trainer (running as the tenant) sees it."""
    return layout.absolute(settings.storage_root, tenant, layout.job(job_id))


def job_spec(settings: Settings, tenant: str, job: FineTuningJob, train: DataFile,
             val: DataFile | None, entry: CatalogEntry, init: DataFile | None = None) -> dict[str, Any]:
    """The trainer's spec for ``job`` of ``tenant`` (plain values: creation and recovery build
    it the same way); ``init``: the parent's adapter tar (continued training). ServiceError
    naming the field if it is invalid."""
    from gateway.services.files import file_parts
    from trainer.contract.errors import SpecError
    from trainer.contract.spec import parse_spec

    hp = dict(job.hyperparameters or {})
    top = {k: hp.pop(k) for k in ("checkpoint_every_steps", "keep_checkpoints") if k in hp}
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
        **({"fault_lr_blowup_at_step": settings.fault_lr_blowup_at_step} if settings.fault_lr_blowup_at_step else {}),
    }
    try:
        parse_spec(spec)
    except SpecError as e:
        raise ServiceError(f"invalid hyperparameters: {e}", param="hyperparameters") from e
    return spec


def saved_spec_matches(saved: bytes | None, expected: dict[str, Any]) -> bool:
    """Whether a spec.json read back from tenant storage (untrusted: the tenant can rewrite it) is
    exactly the spec the gateway would write now: parsed and validated, then compared."""
    from trainer.contract.errors import SpecError
    from trainer.contract.spec import parse_spec

    if saved is None or len(saved) > 1 << 20:
        return False
    try:
        spec = json.loads(saved)
        if not isinstance(spec, dict):
            return False
        parse_spec(spec)
    except (ValueError, SpecError, TypeError):
        return False
    return bool(spec == expected and spec.get("job_dir") == expected["job_dir"])
