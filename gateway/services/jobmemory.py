"""Whether a job fits its ranks' memory, and widening a gang's steps so no rank idles.

Create refuses a job whose estimated per-rank peak (``trainer.memory``) is over what a
rank has; the estimate route reports the same figures instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.config import Settings
from gateway.errors import ServiceError
from trainer.contract.spec import Hyperparameters, JobSpec

if TYPE_CHECKING:
    from trainer.catalog import CatalogEntry
    from trainer.memory import MemoryEstimate, ModelShape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryCheck:
    """A job's estimated per-rank peak (``trainer.memory``) against what one of its ranks has: the
    partition's GPU memory (``Settings.gpu_memory_gib``), or on a CPU partition the job's memory
    limit per rank (``job_mem_mb``); ``limit`` None: not known (a CUDA site that lists no GPU memory)."""

    estimate: MemoryEstimate
    limit: int | None
    partition: str

    @property
    def fits(self) -> bool | None:
        """Whether the estimate is within the limit (None: no limit known)."""
        return None if self.limit is None else self.estimate.total <= self.limit

    def refusal(self) -> str:
        """What create says when it does not fit: the figures and what would make it fit."""
        from trainer.memory import GIB  # lazy: the trainer side (memory), only when a figure is shown

        est = self.estimate
        need, have = est.total / GIB, (self.limit or 0) / GIB
        where = (f"partition {self.partition}'s GPUs have {have:.1f} GiB" if est.device == "cuda"
                 else f"partition {self.partition} trains on the CPU and a rank's memory limit is {have:.1f} GiB")
        return (f"this job needs ~{need:.1f} GiB per {'GPU' if est.device == 'cuda' else 'rank'} (estimate: "
                f"weights {est.weights / GIB:.1f}, activations {est.activations / GIB:.1f}, logits "
                f"{est.logits / GIB:.1f} GiB), {where}: lower hyperparameters.max_seq_len, "
                "or shard the model over more GPUs (resources.fsdp)")

    def as_dict(self) -> dict[str, Any]:
        """The estimate's ``memory`` object: per-rank figure, limit, fits, and the breakdown in GiB."""
        from trainer.memory import GIB  # lazy: the trainer side (memory), only when a figure is shown

        return {"per_gpu_gib": self.estimate.gib(), "limit_gib": round(self.limit / GIB, 2) if self.limit else None,
                "fits": self.fits, "partition": self.partition, "device": self.estimate.device,
                "breakdown": self.estimate.as_dict()}


def memory_limit(settings: Settings) -> tuple[str, str, int | None]:
    """``(partition, device, bytes a rank has)`` for the partition jobs go to: its GPUs' memory when
    ``gpu_memory_gib`` lists it (or ``job_device`` is "cuda": unknown, None), else the CPU and
    ``job_mem_mb`` (the dev cluster: its GPUs are gres entries, and the trainer falls back to the CPU)."""
    partition = settings.slurm_partition or "default"
    gib = settings.gpu_memory_gib.get(partition)
    if settings.job_device != "cpu" and gib is not None:
        return partition, "cuda", int(gib * (1 << 30))
    if settings.job_device == "cuda":
        return partition, "cuda", None
    return partition, "cpu", settings.job_mem_mb * (1 << 20)


def memory_check(settings: Settings, job: JobSpec, shape: ModelShape) -> MemoryCheck:
    """The :class:`MemoryCheck` of the spec ``job`` on a model of ``shape``."""
    from trainer.memory import estimate_job  # lazy: the trainer side (memory), only when a job is admitted

    partition, device, limit = memory_limit(settings)
    est = estimate_job(shape, job.hyperparameters, method=job.method, world_size=job.world_size, fsdp=job.fsdp,
                       device="cuda" if device == "cuda" else "cpu")
    return MemoryCheck(est, limit, partition)


def _model_shape(settings: Settings, entry: CatalogEntry) -> ModelShape | None:
    """The catalog model's shape from its config.json; None (no memory check) for one it cannot read."""
    from trainer.catalog import model_dir  # lazy: the trainer side (catalog), only when a job is admitted
    from trainer.memory import read_shape  # lazy: the trainer side (memory), only when a job is admitted

    try:
        return read_shape(model_dir(settings.models_root, entry.name, entry.digest))
    except ValueError as e:
        log.warning("no memory estimate for model %s: %s", entry.name, e)
        return None


RANK_ROWS = ("batch_size_tokens", "max_seq_len")


def widen_for_ranks(hp: dict[str, Any], method: str, gpus: int) -> str | None:
    """Keep every rank busy: a step's rows are dealt out ``rows[rank::gpus]``, and a full step packs
    into at least ``ceil(batch_size_tokens / row)`` rows (``row``: ``max_seq_len``, DPO
    ``2 * max_seq_len``), so fewer than ``gpus`` of them leaves ranks idle every step.

    When ``batch_size_tokens`` is the default, it is widened in ``hp`` to ``gpus x row`` and the
    returned note says so: recorded with the job, so its spec, its checkpoints and any resume (on
    however many ranks) see the same steps. When the request set it, ServiceError (400) with the
    figure: an explicit budget is the user's, not ours to change. None: nothing to do (or values
    the spec check refuses later)."""
    defaults = Hyperparameters()
    seq = hp.get("max_seq_len", defaults.max_seq_len)
    budget = hp.get("batch_size_tokens", defaults.batch_size_tokens)
    if gpus <= 1 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (seq, budget)):
        return None
    row = 2 * seq if method == "dpo" else seq
    rows = -(-budget // row)        # a full step packs into at least this many rows
    if rows >= gpus:
        return None
    need = gpus * row
    if "batch_size_tokens" in hp:
        raise ServiceError(
            f"hyperparameters.batch_size_tokens ({budget}) gives each step at most {rows} row(s) of "
            f"{row} tokens, fewer than the {gpus} GPUs: {gpus - rows} rank(s) would idle every step; set "
            f"batch_size_tokens to at least {need}, lower max_seq_len, or ask for fewer GPUs",
            param="hyperparameters.batch_size_tokens", code="idle_ranks")
    hp["batch_size_tokens"] = need
    return (f"batch_size_tokens widened from the default {budget} to {need} so that each of the {gpus} "
            f"ranks has a row of {row} tokens every step")
