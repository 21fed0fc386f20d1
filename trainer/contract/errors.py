"""Exception hierarchy of the trainer.

Every error a tenant or an operator can act on is a ``TrainerError``; the
entry point maps each class to an exit code (see ``trainer.contract.exitcodes``).
Messages name the field, the line or the file, never dataset text.

In the contract because the spec's and the line grammar's validators raise ``SpecError`` and
``DatasetError`` and the contract imports nothing outside itself; the whole hierarchy moved
with them (it is pure), so there is one place for the trainer's errors, not two.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base class of every error the trainer raises on purpose."""


class SpecError(TrainerError):
    """The job spec is missing, unreadable or invalid (names the field)."""


class DatasetError(TrainerError):
    """A dataset file is unreadable, tampered with or holds an invalid line."""


class ModelDigestError(TrainerError):
    """The base model on disk does not match the digest pinned in the spec."""


class CatalogError(TrainerError):
    """The base-model catalog cannot add, list or find a model."""


class CheckpointError(TrainerError):
    """A checkpoint cannot be written or does not belong to this job."""


class GpuUnavailableError(TrainerError):
    """The spec asks for CUDA (``device: "cuda"``) but this node cannot use it."""


class LaunchError(TrainerError):
    """The processes launched do not match the spec (``world_size``) or cannot reach each other."""


class DivergedError(TrainerError):
    """The training loss became NaN or infinite: the run cannot recover (a user error: lower the learning rate)."""


class PeerError(TrainerError):
    """A collective with the other ranks failed: one of them died, or did not answer within the timeout."""


class ExportError(TrainerError):
    """An adapter cannot be exported for serving (missing files, an existing output, a template that changed)."""
