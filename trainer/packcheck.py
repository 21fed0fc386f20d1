"""Refuse a base model whose loss on a packed row differs from its loss unpacked.

Padding-free packing (``trainer.packing``) relies on the architecture reading
``position_ids``: when they restart at 0, transformers builds a block-diagonal
causal mask. An architecture that builds its mask without them (in transformers
5.24 OPT, BioGPT, XGLM, BLOOM and MPT do not pass ``position_ids`` to
``create_causal_mask``) lets each packed example attend to the ones before it:
nothing fails, the model silently learns from its neighbours. ``models add``
runs :func:`check_packing` on the copied model before its entry becomes visible.

The model is loaded as the trainer loads it (4-bit NF4 via
``trainer.model.load_base_model``) and the losses come from the trainer's own
``row_loss``, so the check exercises the forward call that training makes. It
runs with the attention the trainer picks here (``sft_varlen`` on the CPU,
which keeps examples apart by itself) and again with ``sdpa``, the path a
training node without a varlen kernel falls back to, whose mask comes from
transformers' reading of ``position_ids``: a model must pass both.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.errors import CatalogError
from trainer.packing import IGNORE, Example, Row, build_row

PROBE_LENGTHS = (16, 12)
# Per-token mean loss; float32 differs by ~1e-6 here, 16-bit compute by far more.
TOLERANCE = {"float32": 1e-3}
TOLERANCE_16BIT = 5e-2


def probe_examples(pool: Sequence[int], seed: int = 0) -> list[Example]:
    """Return 3 fully trained examples of tokens drawn from ``pool``, fixed by ``seed``.

    The third repeats the first: a model that sees across the boundary can copy
    it, so leakage shows even in models that otherwise ignore their context.
    """
    rng = random.Random(seed)
    ids = [tuple(rng.choice(pool) for _ in range(n)) for n in PROBE_LENGTHS]
    ids.append(ids[0])
    return [Example(t, (1,) * len(t), line=i + 1) for i, t in enumerate(ids)]


def probe_rows(examples: list[Example]) -> tuple[list[Row], list[Row]]:
    """Return (each example alone, the packed row once per example with only its targets)."""
    alone = [build_row([e]) for e in examples]
    packed = build_row(examples)
    rows, offset = [], 0
    for example in examples:
        targets = [IGNORE] * len(packed.targets)
        end = offset + len(example)
        targets[offset:end] = packed.targets[offset:end]
        rows.append(Row(packed.input_ids, packed.position_ids, targets))
        offset = end
    return alone, rows


def tolerance_for(dtype: str) -> float:
    """Return the largest per-token loss difference accepted for a compute ``dtype``."""
    return TOLERANCE.get(dtype, TOLERANCE_16BIT)


def compare(name: str, alone: list[float], packed: list[float], dtype: str) -> float:
    """Return the largest |packed - unpacked| per-token loss over the probe examples.

    Raises:
        CatalogError: a difference exceeds the tolerance of ``dtype``.
    """
    tolerance = tolerance_for(dtype)
    if not all(math.isfinite(x) for x in alone + packed):
        raise CatalogError(f"model {name}: the probe loss is not finite ({alone} / {packed}); check its weights")
    diffs = [abs(p - a) for a, p in zip(alone, packed, strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    if diffs[worst] > tolerance:
        raise CatalogError(
            f"model {name} ignores packed-sequence boundaries: on probe example {worst + 1} of "
            f"{len(diffs)} the packed loss {packed[worst]:.4f} != unpacked {alone[worst]:.4f} "
            f"(|diff| {diffs[worst]:.4f} > tolerance {tolerance:g} for {dtype} compute); "
            "it cannot be trained with padding-free packing - pick another architecture"
        )
    return diffs[worst]


def _has_bitsandbytes() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def _load(path: Path, name: str) -> tuple[Any, Any, str | None]:
    """Return (model, tokenizer, quantization): 4-bit like the trainer, float32 without bnb."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.model import load_base_model

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if not _has_bitsandbytes():  # e.g. an admin host without it: the masking code is the same
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer, None
        return load_base_model(path), tokenizer, "nf4"
    except Exception as e:  # noqa: BLE001 - any load failure means the trainer cannot use it either
        raise CatalogError(
            f"model {name}: cannot be loaded as the trainer loads it ({type(e).__name__}: {e}); "
            "a catalog model needs config.json, weights and a tokenizer that transformers can read"
        ) from e


def _losses(model: Any, rows: list[Row]) -> list[float]:
    import torch

    from trainer.model import row_loss

    out = []
    with torch.no_grad():
        for row in rows:
            loss, n, _ = row_loss(model, row)
            out.append(float(loss) / n)
    return out


def check_packing(path: str | Path, name: str) -> dict[str, Any]:
    """Load the model at ``path`` and compare its packed and unpacked probe losses.

    Returns the record kept in the catalog entry (``passed``, ``max_abs_diff``,
    ``tolerance``, ``compute_dtype``, ``quantization``, ``device``). Raises:
        CatalogError: the model cannot be loaded or run, or ignores packed boundaries.
    """
    import torch

    model, tokenizer, quantization = _load(Path(path), name)
    try:
        model.eval()
        dtype = str(model.dtype).removeprefix("torch.")
        size = min(len(tokenizer), model.get_input_embeddings().num_embeddings)
        special = set(tokenizer.all_special_ids)
        alone_rows, packed_rows = probe_rows(probe_examples([i for i in range(size) if i not in special]))
        loaded = str(getattr(model.config, "_attn_implementation", "sdpa"))
        worst = 0.0
        for attention in dict.fromkeys([loaded, "sdpa"]):
            if attention != loaded:
                model.set_attn_implementation(attention)
            try:
                alone, packed = _losses(model, alone_rows), _losses(model, packed_rows)
            except (TypeError, ValueError, RuntimeError, IndexError) as e:
                raise CatalogError(
                    f"model {name}: the trainer's packed forward (position_ids, no attention mask, "
                    f"attention {attention}) fails on it ({type(e).__name__}: {e}); it cannot be trained here"
                ) from e
            worst = max(worst, compare(f"{name} (attention {attention})", alone, packed, dtype))
        device = next(p.device for p in model.parameters()).type
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {
        "passed": True,
        "attention": sorted({loaded, "sdpa"}),
        "max_abs_diff": worst,
        "tolerance": tolerance_for(dtype),
        "compute_dtype": dtype,
        "quantization": quantization,
        "device": device,
    }
