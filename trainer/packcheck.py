"""Refuse a base model that does not train packed as eager attention scores it unpacked.

Padding-free packing (``trainer.packing``) relies on two things: the architecture reading
``position_ids`` (when they restart at 0, transformers builds a block-diagonal causal mask;
in transformers 5.24 OPT, BioGPT, XGLM, BLOOM and MPT build their mask without them, so a
packed example attends to the ones before it), and the attention the trainer runs honouring
what the architecture asks of it (a sliding window, soft-capped scores, attention sinks:
``trainer.attention``). Either failure is silent: the model learns from its neighbours, or
from a context its eager attention never sees. ``models add`` runs :func:`check_packing` on
the copied model before its entry becomes visible.

The model is loaded as the trainer loads it (4-bit NF4 via
``trainer.model.load_base_model``) and the losses come from the trainer's own ``row_loss``.
The reference is each probe example alone under ``eager`` attention (transformers' own
masks and scores). The probes are longer than the model's sliding window, and the packed row
is scored on every attention path the trainer may take: the one it picked here
(``sft_varlen``: one SDPA per example on the CPU; on a GPU torch's varlen kernel or
flash_attention_2), on a host without CUDA the CUDA varlen path's logic with the reference
kernel (``trainer.attention.EMULATED``: what a GPU node will run, argument building
included), and the dense-mask fallback of a GPU without a varlen kernel (``sdpa``, whose mask
comes from transformers' reading of ``position_ids``; ``eager``, the same mask, for an
architecture that refuses sdpa). A model must pass them all.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer import attention
from trainer.contract.errors import CatalogError
from trainer.model import load_base_model, row_loss
from trainer.packing import IGNORE, Example, Row, build_row

PROBE_LENGTHS = (16, 12)
# Per-token mean loss; float32 differs by ~1e-6 here (eager vs sdpa), 16-bit compute by far more.
TOLERANCE = {"float32": 1e-3}
TOLERANCE_16BIT = 5e-2
REFERENCE = "eager"


def sliding_window(config: Any) -> int | None:
    """The sliding window some layer of ``config`` attends within, or None (all layers full).

    Mistral and Phi-3 apply ``sliding_window`` to every layer; models with ``layer_types``
    (Gemma2/3, Qwen2/3, SmolLM3) only to their ``sliding_attention`` layers."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(window, int) or (types is not None and "sliding_attention" not in types):
        return None
    return window


def probe_lengths(window: int | None) -> tuple[int, int]:
    """The probe examples' lengths: the first one longer than ``window`` (so its last tokens
    must not see its first ones), the second short."""
    first, second = PROBE_LENGTHS
    return (first if window is None else max(first, window + 8), second)


def probe_examples(pool: Sequence[int], seed: int = 0, window: int | None = None) -> list[Example]:
    """Return 3 fully trained examples of tokens drawn from ``pool``, fixed by ``seed``.

    The third repeats the first: a model that sees across the boundary can copy
    it, so leakage shows even in models that otherwise ignore their context.
    The first is longer than ``window`` (:func:`probe_lengths`).
    """
    rng = random.Random(seed)
    ids = [tuple(rng.choice(pool) for _ in range(n)) for n in probe_lengths(window)]
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
            f"model {name} does not train packed as it scores unpacked: on probe example {worst + 1} of "
            f"{len(diffs)} the packed loss {packed[worst]:.4f} != unpacked {alone[worst]:.4f} under "
            f"{REFERENCE} attention (|diff| {diffs[worst]:.4f} > tolerance {tolerance:g} for {dtype} compute): "
            "it ignores packed-sequence boundaries, or this attention path ignores the model's own "
            "(a sliding window, soft-capping, sinks); it cannot be trained with padding-free packing - "
            "pick another architecture"
        )
    return diffs[worst]


def _has_bitsandbytes() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def _load_failure(name: str, e: Exception) -> CatalogError:
    return CatalogError(
        f"model {name}: cannot be loaded as the trainer loads it ({type(e).__name__}: {e}); "
        "a catalog model needs config.json, weights and a tokenizer that transformers can read"
    )


def load_config(path: str | Path, name: str) -> Any:
    """Return the model's transformers config.

    Raises:
        CatalogError: transformers cannot read it.
    """
    from transformers import AutoConfig  # lazy: transformers

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any load failure means the trainer cannot use it either
        raise _load_failure(name, e) from e


def _load(path: Path, name: str) -> tuple[Any, Any, str | None]:
    """Return (model, tokenizer, quantization): 4-bit like the trainer, float32 without bnb."""
    import torch  # lazy: torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers


    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if not _has_bitsandbytes():  # e.g. an admin host without it: the masking code is the same
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer, None
        return load_base_model(path), tokenizer, "nf4"
    except Exception as e:  # noqa: BLE001 - any load failure means the trainer cannot use it either
        raise _load_failure(name, e) from e


def attention_paths(model: Any) -> list[str]:
    """The attention implementations the trainer may run ``model`` with: the one it was loaded
    with, the CUDA varlen path's logic (emulated, on a host without CUDA; when the model took
    ``sft_varlen``), and the dense-mask fallback (sdpa, or eager where the model refuses sdpa)."""
    loaded = str(getattr(model.config, "_attn_implementation", "sdpa"))
    paths = [loaded]
    if loaded == attention.VARLEN and next(p.device for p in model.parameters()).type != "cuda":
        paths.append(attention.register_emulated())
    paths.append("sdpa" if getattr(model, "_supports_sdpa", True) else "eager")
    return list(dict.fromkeys(paths))


def _losses(model: Any, rows: list[Row]) -> list[float]:
    import torch  # lazy: torch


    out = []
    with torch.no_grad():
        for row in rows:
            loss, n, _ = row_loss(model, row)
            out.append(float(loss) / n)
    return out


def _path_losses(model: Any, attention: str, rows: list[Row], name: str) -> list[float]:
    """Per-token losses of ``rows`` under ``attention``.

    Raises:
        CatalogError: the forward fails on that path.
    """
    if attention != model.config._attn_implementation:
        model.set_attn_implementation(attention)
    try:
        return _losses(model, rows)
    except (TypeError, ValueError, RuntimeError, IndexError) as e:
        raise CatalogError(
            f"model {name}: the trainer's packed forward (position_ids, no attention mask, "
            f"attention {attention}) fails on it ({type(e).__name__}: {e}); it cannot be trained here"
        ) from e


def check_packing(path: str | Path, name: str) -> dict[str, Any]:
    """Load the model at ``path``; compare its packed probe losses on every attention path with
    the examples' losses alone under eager attention.

    Returns the record kept in the catalog entry (``passed``, ``attention``: the paths checked,
    ``max_abs_diff``, ``diffs`` per path, ``tolerance``, ``compute_dtype``, ``quantization``,
    ``device``, ``reference``, ``sliding_window``, ``probe_lengths``). Raises:
        CatalogError: the model cannot be loaded or run, or a path trains it differently.
    """
    import torch  # lazy: torch

    model, tokenizer, quantization = _load(Path(path), name)
    try:
        model.eval()
        dtype = str(model.dtype).removeprefix("torch.")
        window = sliding_window(model.config)
        size = min(len(tokenizer), model.get_input_embeddings().num_embeddings)
        special = set(tokenizer.all_special_ids)
        pool = [i for i in range(size) if i not in special]
        alone_rows, packed_rows = probe_rows(probe_examples(pool, window=window))
        paths = attention_paths(model)
        alone = _path_losses(model, REFERENCE, alone_rows, name)
        diffs = {}
        for attention in paths:
            packed = _path_losses(model, attention, packed_rows, name)
            diffs[attention] = compare(f"{name} (attention {attention})", alone, packed, dtype)
        device = next(p.device for p in model.parameters()).type
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {
        "passed": True,
        "attention": sorted(paths),
        "max_abs_diff": max(diffs.values()),
        "diffs": diffs,
        "tolerance": tolerance_for(dtype),
        "compute_dtype": dtype,
        "quantization": quantization,
        "device": device,
        "reference": f"{REFERENCE}, each example alone",
        "sliding_window": window,
        "probe_lengths": list(probe_lengths(window)),
    }
