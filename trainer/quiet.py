"""Known-harmless library noise, kept off a person's terminal.

For interactive commands only (``finetune demo``, ``finetune models …``). Inside a job
nothing is silenced: the same lines land in the job's log file (``slurm-<id>.out``),
where an administrator debugging a job wants them, and never in the tenant's job events.

What is silenced, each checked harmless here (FACTS.md):
- bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" (an optional
  accelerated kernel package; the built-in CPU path is used and tested);
- progress bars (transformers' weight loading, the GGUF conversion) and advisory warnings;
- FutureWarning / DeprecationWarning from libraries (notes for their developers, not for
  the person running the demo).
"""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    """Call before importing torch/transformers/bitsandbytes; idempotent."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")          # e.g. transformers' GGUF conversion bar
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
