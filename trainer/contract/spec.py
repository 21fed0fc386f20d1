"""The job spec: the one settings object of a trainer process.

The gateway builds a :class:`JobSpec` and writes it as JSON (``spec.json``);
the trainer reads it with :func:`load_spec`. Pure code: no torch import, so
the gateway can import this module.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer.contract.errors import SpecError

SPEC_VERSION = 1
DEFAULT_CATALOG_ROOT = "/srv/slurm-finetune/models"

_SHA256 = r"^[0-9a-f]{64}$"
_DIGEST = r"^sha256:[0-9a-f]{64}$"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
"""Model names and job ids: one rule for the spec and the catalog."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BaseModelRef(_Strict):
    """A base model pinned by catalog name and digest."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    digest: Annotated[str, Field(pattern=_DIGEST, description="sha256:<64 hex> from the catalog")]
    catalog_root: str = DEFAULT_CATALOG_ROOT


class DatasetRef(_Strict):
    """A chat JSONL file and the sha256 the gateway computed at upload."""

    path: Annotated[str, Field(min_length=1)]
    sha256: Annotated[str, Field(pattern=_SHA256)]


class Hyperparameters(_Strict):
    """Training hyperparameters.

    One optimizer step = whole examples totalling at most ``batch_size_tokens``
    tokens, run as micro-batches (padding-free packed rows of at most
    ``max_seq_len`` tokens) whose gradients are accumulated; the step's loss is
    the mean over all its trained tokens, as if it were one large batch.
    ``max_seq_len`` bounds the attention length (and so its memory);
    ``batch_size_tokens`` only sets how many tokens one update sees.
    ``torch_compile`` compiles the decoder layers with ``torch.compile`` on CUDA
    (ignored on the CPU).

    Warm-up: ``warmup_steps``, or ``warmup_ratio`` of the total steps (rounded
    up); not both. Early stopping: after ``early_stopping_patience`` periodic
    evals (``eval_every_steps``) in a row whose validation loss is not below
    the best so far minus ``early_stopping_min_delta``, training stops and the
    adapter of the best eval is published.

    ``beta`` (DPO only, ``JobSpec.method == "dpo"``): the strength of the
    pull towards the reference policy in the sigmoid loss (TRL's and OpenAI's
    default 0.1); larger keeps the policy closer to the reference.
    """

    epochs: Annotated[int, Field(ge=1, le=100)] = 3
    learning_rate: Annotated[float, Field(gt=0.0, le=1.0)] = 2e-4
    batch_size_tokens: Annotated[int, Field(ge=16, le=1_048_576)] = 4096
    max_seq_len: Annotated[int, Field(ge=8, le=131_072)] = 2048
    lora_r: Annotated[int, Field(ge=1, le=1024)] = 16
    lora_alpha: Annotated[int, Field(ge=1, le=4096)] = 32
    lora_dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.05
    target_modules: Literal["all-linear"] | Annotated[list[str], Field(min_length=1)] = "all-linear"
    warmup_steps: Annotated[int, Field(ge=0, le=1_000_000)] = 10
    warmup_ratio: Annotated[float, Field(ge=0.0, le=0.5)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 0
    eval_every_steps: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    max_steps: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    gradient_checkpointing: bool = True
    early_stopping_patience: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    early_stopping_min_delta: Annotated[float, Field(ge=0.0, le=100.0)] = 0.0
    torch_compile: bool = False
    beta: Annotated[float, Field(gt=0.0, le=100.0)] = 0.1

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            for name in value:
                if not re.fullmatch(r"[A-Za-z0-9_.]{1,100}", name):
                    raise ValueError(f"invalid module name {name!r}")
        return value

    @model_validator(mode="after")
    def _seq_fits_row(self) -> Hyperparameters:
        if self.max_seq_len > self.batch_size_tokens:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) must be <= batch_size_tokens "
                f"({self.batch_size_tokens}): one example must fit in one optimizer step"
            )
        return self

    @model_validator(mode="after")
    def _one_warmup(self) -> Hyperparameters:
        if self.warmup_ratio is not None and "warmup_steps" in self.model_fields_set:
            raise ValueError(
                f"set warmup_steps ({self.warmup_steps}) or warmup_ratio ({self.warmup_ratio}), not both: "
                "warmup_ratio derives the warm-up steps from the total steps"
            )
        return self

    @model_validator(mode="after")
    def _early_stopping_needs_evals(self) -> Hyperparameters:
        if self.early_stopping_patience is not None and self.eval_every_steps is None:
            raise ValueError(
                f"early_stopping_patience ({self.early_stopping_patience}) needs eval_every_steps: "
                "early stopping counts the periodic validation evals; set eval_every_steps too"
            )
        if self.early_stopping_min_delta and self.early_stopping_patience is None:
            raise ValueError(
                f"early_stopping_min_delta ({self.early_stopping_min_delta}) does nothing without "
                "early_stopping_patience: set both, or neither"
            )
        return self

    def warmup_for(self, total_steps: int) -> int:
        """Return the warm-up steps of a run of ``total_steps``: ``warmup_steps`` or ceil(ratio * total)."""
        if self.warmup_ratio is None:
            return self.warmup_steps
        # the epsilon keeps e.g. 0.1 * 30 = 3.0000000000000004 at 3
        return math.ceil(self.warmup_ratio * total_steps - 1e-9)


class JobSpec(_Strict):
    """Everything one training job needs; written by the gateway, read by the trainer.

    ``device``: ``"cuda"`` (the job was given a GPU: fail at once, exit
    ``GPU_UNAVAILABLE``, if CUDA is not usable rather than train on the CPU),
    ``"cpu"`` (never use a GPU) or ``"auto"`` (CUDA when available, else CPU).

    ``world_size``: the number of data-parallel ranks (one process per GPU) the job
    is launched with; the trainer refuses a launch with another number. Steps, data
    order and checkpoints do not depend on it (see ``trainer.distributed``).

    ``fsdp``: shard the 4-bit base, LoRA weights and optimizer state over the
    ranks (FSDP2) instead of giving every rank the whole model: for a base too
    large for one GPU. Same steps and checkpoint format as without.

    ``init_adapter``: continued training. A published adapter tar (the parent
    model's, pinned by its sha256) whose LoRA weights replace the seeded init
    before the first step; its LoRA shape must be this spec's. A checkpoint of
    this job, when there is one, still wins (a resumed attempt continues itself).

    ``method``: ``"supervised"`` (SFT on chat data) or ``"dpo"`` (direct preference
    optimisation on preference pairs, :mod:`trainer.dpo`; the train/validation files are
    then OpenAI preference JSONL). A DPO step holds whole pairs, so ``batch_size_tokens``
    must be at least ``2 * max_seq_len``; DPO is not sharded (no ``fsdp``) yet.

    Only what a user may ask: the test suite's fault injection is no field of the spec (a
    spec naming one is refused as an unknown key); see ``trainer.jobenv.test_fault_step``.
    """

    version: Literal[1] = 1
    job_id: Annotated[str, Field(pattern=NAME_PATTERN)] | None = None
    base_model: BaseModelRef
    train: DatasetRef
    validation: DatasetRef | None = None
    validation_split: Annotated[float, Field(gt=0.0, le=0.5)] = 0.1
    hyperparameters: Hyperparameters = Hyperparameters()
    job_dir: Annotated[str, Field(min_length=1)]
    checkpoint_every_steps: Annotated[int, Field(ge=1, le=10_000_000)] = 100
    keep_checkpoints: Annotated[int, Field(ge=1, le=100)] = 2
    device: Literal["auto", "cuda", "cpu"] = "auto"
    world_size: Annotated[int, Field(ge=1, le=1024)] = 1
    fsdp: bool = False
    init_adapter: DatasetRef | None = None
    method: Literal["supervised", "dpo"] = "supervised"

    @model_validator(mode="after")
    def _method_fits(self) -> JobSpec:
        hp = self.hyperparameters
        if self.method != "dpo" and "beta" in hp.model_fields_set:
            raise ValueError("hyperparameters.beta is a DPO hyperparameter: set method 'dpo', or leave beta out")
        if self.method == "dpo" and hp.batch_size_tokens < 2 * hp.max_seq_len:
            raise ValueError(
                f"method dpo: batch_size_tokens ({hp.batch_size_tokens}) must be >= 2 * max_seq_len "
                f"({2 * hp.max_seq_len}): one optimizer step must hold a whole pair (both sides)"
            )
        if self.method == "dpo" and "lora_dropout" in hp.model_fields_set and hp.lora_dropout:
            raise ValueError(
                f"method dpo trains without dropout (as TRL does: the policy is scored like its reference), "
                f"so hyperparameters.lora_dropout ({hp.lora_dropout}) would not be used: leave it out, or set 0"
            )
        if self.method == "dpo" and self.fsdp:
            raise ValueError("method dpo does not run sharded (fsdp) yet: train it data parallel, without fsdp")
        return self


def _model_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """Return the pydantic model class reached by following ``loc`` from ``model``."""
    current: type[BaseModel] = model
    for part in loc:
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        found = None
        for arg in _flatten(field.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                found = arg
        if found is None:
            return None
        current = found
    return current


def _flatten(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType or origin is Annotated:
        return [a for arg in typing.get_args(annotation) for a in _flatten(arg)]
    return [annotation]


def _describe(error: Any) -> str:
    loc = tuple(error["loc"])
    field = ".".join(str(p) for p in loc) or "<spec>"
    if error["type"] == "extra_forbidden":
        parent = _model_at(JobSpec, loc[:-1])
        valid = ", ".join(sorted(parent.model_fields)) if parent else "?"
        return f"{field}: unknown key; valid keys here are: {valid}"
    if error["type"] == "missing":
        return f"{field}: required field is missing"
    if error["type"] == "value_error":  # our validators' own sentences (they name their fields)
        text = str(error["msg"]).removeprefix("Value error, ")
        return text if not loc else f"{field}: {text}"
    message = f"{field}: {error['msg']}"
    bounds = _range_of(loc)
    if bounds and error["type"] in _RANGE_ERRORS:
        message += f" (allowed range: {bounds})"
    return message


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _range_of(loc: tuple[int | str, ...]) -> str | None:
    """Return e.g. ``1 <= epochs <= 100`` for the numeric field at ``loc``."""
    parent = _model_at(JobSpec, loc[:-1]) if loc else None
    if parent is None or str(loc[-1]) not in parent.model_fields:
        return None
    found = bounds(parent, str(loc[-1]))
    return found.describe(str(loc[-1])) if found else None


@dataclass(frozen=True)
class Bounds:
    """The range of a numeric field, read from its pydantic constraints: the CLI, the portal and
    the gateway's own checks take a range from here, so it is written once (in the ``Field``)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False     # ``gt``: the low end itself is refused
    high_open: bool = False    # ``lt``: the high end itself is refused

    def __bool__(self) -> bool:
        return self.low is not None or self.high is not None

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies in the range."""
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return not (self.high is not None and (value > self.high or (self.high_open and value == self.high)))

    def describe(self, name: str) -> str:
        """The range as text, e.g. ``1 <= epochs <= 100`` or ``0.0 < beta <= 100.0``."""
        low = "" if self.low is None else f"{self.low} {'<' if self.low_open else '<='} "
        high = "" if self.high is None else f" {'<' if self.high_open else '<='} {self.high}"
        return f"{low}{name}{high}"


def bounds(model: type[BaseModel], name: str) -> Bounds:
    """The :class:`Bounds` of field ``name`` of ``model`` (empty for a field without a range)."""
    field = model.model_fields[name]
    low = high = None
    low_open = high_open = False
    for meta in _constraints(field.metadata, field.annotation):
        if getattr(meta, "ge", None) is not None:
            low, low_open = meta.ge, False
        if getattr(meta, "gt", None) is not None:
            low, low_open = meta.gt, True
        if getattr(meta, "le", None) is not None:
            high, high_open = meta.le, False
        if getattr(meta, "lt", None) is not None:
            high, high_open = meta.lt, True
    return Bounds(low, high, low_open, high_open)


def _constraints(metadata: list[Any], annotation: Any) -> list[Any]:
    """Return the constraint objects (``Ge``, ``Le``...) of a field, Optional included."""
    found = list(metadata)
    for item in _flatten(annotation):
        found.append(item)
        found.extend(getattr(item, "metadata", []) or [])
    return found


def parse_spec(data: Any) -> JobSpec:
    """Validate a decoded JSON object and return the :class:`JobSpec`.

    Raises:
        SpecError: one line per problem, each naming the field (and the valid
            keys for an unknown key, the range for an out-of-range value).
    """
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        problems = "\n".join(f"  - {_describe(err)}" for err in e.errors())
        raise SpecError(f"invalid job spec ({e.error_count()} problem(s)):\n{problems}") from e


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a spec JSON file.

    Raises:
        SpecError: the file is missing, is not JSON, or fails validation.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"cannot read spec file {path}: {e.strerror}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"spec file {path} is not valid JSON (line {e.lineno}): {e.msg}") from e
    return parse_spec(data)


HYPERPARAMETER_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {name: field.default for name, field in Hyperparameters.model_fields.items()})
"""Every hyperparameter's default (``learning_rate``'s is also the base of OpenAI's multiplier)."""

HYPERPARAMETER_BOUNDS: Mapping[str, Bounds] = MappingProxyType(
    {name: b for name in Hyperparameters.model_fields if (b := bounds(Hyperparameters, name))})
"""The range of every numeric hyperparameter."""

JOB_BOUNDS: Mapping[str, Bounds] = MappingProxyType(
    {name: b for name in JobSpec.model_fields if (b := bounds(JobSpec, name))})
"""The range of every numeric field of the spec itself (``checkpoint_every_steps``, ``world_size``...)."""


_ADDED_HYPERPARAMETERS = ("warmup_ratio", "early_stopping_patience", "early_stopping_min_delta", "torch_compile",
                          "beta")
_ADDED_FIELDS = ("device", "world_size", "fsdp", "init_adapter", "method")
"""Fields added after version 1 shipped: left out of the canonical JSON while at their default,
so a spec that does not use them keeps its hash (and an in-flight job its checkpoints) across
an upgrade."""


def spec_to_json(spec: JobSpec) -> str:
    """Return the canonical JSON text of ``spec`` for hashing (sorted keys, defaults included
    except those of ``_ADDED_HYPERPARAMETERS`` and ``_ADDED_FIELDS``)."""
    data = spec.model_dump(mode="json")
    fields = Hyperparameters.model_fields
    for name in _ADDED_HYPERPARAMETERS:
        if data["hyperparameters"][name] == fields[name].default:
            del data["hyperparameters"][name]
    for name in _ADDED_FIELDS:
        if data[name] == JobSpec.model_fields[name].default:
            del data[name]
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def spec_data(spec: JobSpec) -> dict[str, Any]:
    """``spec`` as plain JSON values: the fields that were set (defaults left to the trainer, so a
    field added later does not appear in an older job's file); :func:`parse_spec` reads it back equal."""
    return spec.model_dump(mode="json", exclude_unset=True)


def spec_file_text(spec: JobSpec) -> str:
    """The text of ``spec.json`` for ``spec`` (:func:`spec_data`, indented for a reader)."""
    return json.dumps(spec_data(spec), indent=1)


def spec_hash(spec: JobSpec) -> str:
    """Return ``sha256:<hex>`` of the canonical JSON of ``spec``."""
    return "sha256:" + hashlib.sha256(spec_to_json(spec).encode()).hexdigest()


def checkpoint_hash(spec: JobSpec) -> str:
    """Return the hash a checkpoint is pinned to: :func:`spec_hash` of ``spec`` laid out on one
    process (``world_size`` 1, no ``fsdp``). Steps, data order and the checkpoint format do not
    depend on the layout, so a checkpoint resumes on any number of ranks, sharded or not; for a
    one-process spec it is the spec hash itself (checkpoints written before it existed still match)."""
    return spec_hash(spec.model_copy(update={"world_size": 1, "fsdp": False}))

