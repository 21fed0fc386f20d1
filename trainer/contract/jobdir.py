"""The names of the files and folders of a job directory, relative to it.

The trainer writes a job directory and the gateway reads it (through its storage broker, as
the tenant's files): both take the names from here, so neither side can rename one alone.
Tenant-root paths (``jobs/<job id>``) stay with the gateway's ``storage.layout``; this module
knows only what lies inside one job's directory::

    spec.json                               the job spec (the gateway writes it)
    events.jsonl                            the trainer's progress (the reconciler reads it)
    attempts/<n>/staging/                   an attempt's finished results, COMPLETE last
        adapter files, tokenizer files, eval.json, metrics.jsonl, manifest.json, COMPLETE
    checkpoints/step-<n>/                   a checkpoint, COMPLETE last
        adapter.safetensors, adapter_config.json, state.pt, progress.json,
        best.safetensors (early stopping), COMPLETE
"""

from __future__ import annotations

import re

SPEC = "spec.json"
EVENTS = "events.jsonl"
ATTEMPTS = "attempts"
STAGING = "staging"
CHECKPOINTS = "checkpoints"

COMPLETE = "COMPLETE"
"""Written last into a staging or checkpoint directory: readers trust only directories holding it."""

EVAL = "eval.json"
METRICS = "metrics.jsonl"
MANIFEST = "manifest.json"

CKPT_ADAPTER = "adapter.safetensors"
CKPT_STATE = "state.pt"
CKPT_PROGRESS = "progress.json"
CKPT_BEST = "best.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter config, as ``save_pretrained`` writes it, in a staging dir and in each checkpoint:
a checkpoint of a job that did not finish is published with it (``from_checkpoint``, and a download
that peft loads)."""

STEP_DIR = re.compile(r"^step-(\d+)$")
"""A checkpoint directory's name (see :func:`step_dir_name`)."""


def step_dir_name(step: int) -> str:
    """The name of the checkpoint directory of ``step`` under ``checkpoints/`` (``step-<n>``)."""
    return f"step-{step}"


def staging_parts(attempt: int) -> tuple[str, str, str]:
    """The staging directory of attempt ``attempt``, relative to the job directory, as components."""
    return (ATTEMPTS, str(attempt), STAGING)
