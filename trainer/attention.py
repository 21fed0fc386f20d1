"""Variable-length attention over a packed row: each example attends to itself only, with no mask.

Registered with transformers as ``VARLEN`` (``attn_implementation="sft_varlen"``). A name
transformers has no mask function for makes it build no attention mask at all, so a packed
row never costs a dense T x T mask. The example boundaries come from the caller
(``cu_seq_lens_q``, an int32 tensor on the row's device, and ``max_length_q``, a python int:
the keywords transformers' flash-attention path takes; ``trainer.model.row_loss`` passes
them), else from ``position_ids`` restarting at 0.

What an architecture asks of its attention is honoured as its eager attention does it
(transformers 5.24):

- ``sliding_window`` W (Mistral; Gemma2/Gemma3 and Qwen2/Qwen3 with sliding layers, per layer):
  a query sees the W most recent keys of its example, itself included (``masking_utils``'
  ``kv_idx > q_idx - W``; transformers' flash path passes ``window_size=(W - 1, ...)``).
- ``softcap`` c (Gemma2): scores become ``c * tanh(scores / c)`` before masking and softmax.
- ``s_aux`` (GPT-OSS attention sinks): one more logit per head in every query's softmax,
  whose probability is dropped (it has no value).

Paths:

- CUDA: ``torch.nn.attention.varlen.varlen_attn`` (flash-attention's varlen kernel, shipped
  in torch; bf16/fp16 inputs), one call for the row: ``window_size=(-1, 0)`` (causal) or
  ``(W - 1, 0)``. It reads only the caller's tensor and int, so it never syncs with the host
  and gives ``torch.compile`` nothing to break the graph on. That kernel has neither
  soft-capping nor sinks: a layer that asks for either runs the per-example path below
  instead (logged once per job; a host sync per such layer).
- CPU: one ``scaled_dot_product_attention`` per example (causal, or a window mask for an
  example longer than W): no mask over the row, the scores are sum(L_i^2) instead of T^2.
  With soft-capping or sinks, the example's scores are computed explicitly, as eager does.
  The python bounds come from the (CPU) boundary tensor: no device sync.

The kernel of the CUDA path is a parameter (:func:`varlen_attention_forward`'s ``kernel``):
:func:`reference_varlen_attn` implements torch's kernel contract (``cu_seqlens``,
``max_len``, ``window_size``, GQA) in plain torch, so the CUDA path's argument building
runs and is checked on the CPU (``EMULATED``; ``trainer.packcheck`` and the architecture
matrix test use it). Without boundaries (a plain unpacked batch) a row is one example.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger("trainer")

VARLEN = "sft_varlen"
EMULATED = "sft_varlen_emulated"
"""The CUDA path's logic with :func:`reference_varlen_attn` as its kernel (any device)."""

Kernel = Callable[..., "torch.Tensor"]
"""torch's ``varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa)``."""

_logged: set[str] = set()


def register() -> str:
    """Register ``VARLEN`` with transformers (idempotent); return its name."""
    from transformers import AttentionInterface  # lazy: transformers

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    return VARLEN


def register_emulated() -> str:
    """Register ``EMULATED`` (the CUDA path with the reference kernel) with transformers; return its name."""
    from transformers import AttentionInterface  # lazy: transformers

    AttentionInterface.register(EMULATED, functools.partial(varlen_attention_forward, kernel=reference_varlen_attn))
    return EMULATED


def cuda_varlen_available() -> bool:
    """Whether torch ships the varlen kernel and the GPU can run it (flash attention: Ampere or newer)."""
    import torch  # lazy: torch

    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  # lazy: torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def boundaries(position_ids: torch.Tensor | None, length: int) -> list[int]:
    """``[0, ..., length]``: where each packed example starts (``position_ids`` restarting at 0)."""
    if position_ids is None:
        return [0, length]
    starts = (position_ids.reshape(-1)[:length] == 0).nonzero().flatten().tolist()
    bounds = [0, *(s for s in starts if s > 0), length]
    return bounds


def window_size(sliding_window: int | None, max_len: int) -> tuple[int, int]:
    """The kernel's ``(left, right)`` for a causal layer with ``sliding_window`` (None: full).

    flash-attention counts ``left`` keys before the query plus the query itself, transformers
    counts W keys in all, so W becomes ``W - 1``; a window no shorter than the longest example
    changes nothing and stays plain causal (the kernel's faster path)."""
    if sliding_window is None or max_len <= sliding_window:
        return (-1, 0)
    return (sliding_window - 1, 0)


def varlen_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    *,
    kernel: Kernel | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` (1, H, T, D), ``key``/``value`` (1, H_kv, T, D);
    returns ((1, T, H, D), None).

    ``kernel``: the varlen kernel (default: torch's on CUDA, none on the CPU, where each example
    runs alone). Raises:
        ValueError: a batch of more than one row, or a mask (both mean this is not a packed row),
            or attention dropout.
    """
    if dropout:
        raise ValueError(f"{VARLEN} has no attention dropout (got {dropout})")
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError(f"{VARLEN} runs one packed row without a mask (got batch {query.shape[0]}, "
                         f"mask {'set' if attention_mask is not None else 'none'})")
    if kernel is None and query.is_cuda:
        kernel = _torch_varlen
    groups = query.shape[1] // key.shape[1]
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if kernel is not None and softcap is None and s_aux is None:
        if cu is None or longest is None:  # not from row_loss: derive them (a host sync)
            bounds = boundaries(kwargs.get("position_ids"), query.shape[2])
            cu = _bounds_tensor(bounds, query.device)
            longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
        out = _varlen(query, key, value, cu, int(longest), scaling, sliding_window, groups, kernel)
    else:
        if kernel is not None:
            _log_once(module, softcap, s_aux)
        bounds = [int(b) for b in cu.tolist()] if cu is not None else boundaries(kwargs.get("position_ids"),
                                                                                 query.shape[2])
        out = _per_example(query, key, value, bounds, scaling, groups, sliding_window, softcap, s_aux)
    return out.unsqueeze(0), None   # (1, T, H, D), as transformers' other kernels return


def _bounds_tensor(bounds: list[int], device: torch.device) -> torch.Tensor:
    import torch  # lazy: torch

    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _log_once(module: Any, softcap: float | None, s_aux: torch.Tensor | None) -> None:
    what = f"soft-capped scores (softcap {softcap})" if softcap is not None else "attention sinks (s_aux)"
    model_type = getattr(getattr(module, "config", None), "model_type", "this model")
    if what not in _logged:
        _logged.add(what)
        log.warning("attention %s: %s layers have %s, which the varlen kernel cannot compute; those layers "
                    "run one attention per example (a host sync per layer)", VARLEN, model_type, what)


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, longest: int,
            scaling: float | None, sliding_window: int | None, groups: int, kernel: Kernel) -> torch.Tensor:
    """One kernel call for the row: (T, H, D)."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))   # (T, H, D)
    return kernel(q, k, v, cu, cu, longest, longest, scale=scaling,
                  window_size=window_size(sliding_window, longest), enable_gqa=groups > 1)


def _torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int, **options: Any) -> torch.Tensor:
    """torch's kernel, in the 16-bit type it needs (bf16 unless already fp16/bf16), back in q's type."""
    import torch  # lazy: torch
    from torch.nn.attention.varlen import varlen_attn  # lazy: torch

    half = torch.bfloat16 if q.dtype not in (torch.float16, torch.bfloat16) else q.dtype
    out = varlen_attn(q.to(half), k.to(half), v.to(half), cu_q, cu_k, max_q, max_k, **options)
    assert isinstance(out, torch.Tensor)        # a tuple only with return_aux
    return out.to(q.dtype)


def reference_varlen_attn(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
) -> torch.Tensor:
    """torch's ``varlen_attn`` in plain torch, for self-attention: (T, H, D) inputs, output (T, H, D).

    Each sequence ``cu_seq_q[i]:cu_seq_q[i+1]`` alone; key j is seen by query i when
    ``i - left <= j <= i + right`` (-1: unbounded), flash-attention's ``window_size``.
    Raises:
        ValueError: what the kernel would refuse or get wrong: other key boundaries, boundaries
            not int32 on the query's device, a ``max_q``/``max_k`` below the longest sequence,
            heads that differ without ``enable_gqa``.
    """
    import torch  # lazy: torch
    import torch.nn.functional as F  # lazy: torch

    if cu_seq_k is not cu_seq_q and (cu_seq_k is None or not torch.equal(cu_seq_k, cu_seq_q)):
        raise ValueError("reference varlen attention: self-attention only (cu_seq_k must equal cu_seq_q)")
    if cu_seq_q.dtype != torch.int32 or cu_seq_q.device != query.device:
        raise ValueError(f"cu_seq_q must be int32 on {query.device} (got {cu_seq_q.dtype} on {cu_seq_q.device})")
    bounds = [int(b) for b in cu_seq_q.tolist()]
    longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    if bounds[0] != 0 or bounds[-1] != query.shape[0] or min(max_q, max_k) < longest:
        raise ValueError(f"boundaries {bounds} / max {max_q}, {max_k} do not fit {query.shape[0]} tokens")
    if key.shape[1] != query.shape[1]:
        if not enable_gqa or query.shape[1] % key.shape[1]:
            raise ValueError(f"{query.shape[1]} query heads and {key.shape[1]} key heads need enable_gqa")
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    left, right = window_size
    parts = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        i = torch.arange(b - a, device=query.device)
        offset = i[None, :] - i[:, None]          # key - query
        seen = torch.ones_like(offset, dtype=torch.bool)
        if right >= 0:
            seen &= offset <= right
        if left >= 0:
            seen &= offset >= -left
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        parts.append(F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale).transpose(0, 1))
    return torch.cat(parts)


def _per_example(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
                 scaling: float | None, groups: int, sliding_window: int | None = None,
                 softcap: float | None = None, s_aux: torch.Tensor | None = None) -> torch.Tensor:
    """Each example alone: (T, H, D)."""
    import torch  # lazy: torch
    import torch.nn.functional as F  # lazy: torch

    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    parts = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]
        windowed = sliding_window is not None and b - a > sliding_window
        if softcap is None and s_aux is None and not windowed:
            parts.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling))
            continue
        seen = _causal_window(b - a, sliding_window, query.device)
        if softcap is None and s_aux is None:
            parts.append(F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scaling))
        else:
            parts.append(_explicit(q, k, v, seen, scaling, softcap, s_aux))
    return torch.cat(parts, dim=2)[0].transpose(0, 1)   # (T, H, D)


def _causal_window(length: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """(L, L) bool: key j seen by query i when ``i - W < j <= i`` (W None: ``j <= i``)."""
    import torch  # lazy: torch

    i = torch.arange(length, device=device)
    back = i[:, None] - i[None, :]                # query - key
    seen = back >= 0
    if sliding_window is not None:
        seen &= back < sliding_window
    return seen


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, scaling: float | None,
              softcap: float | None, s_aux: torch.Tensor | None) -> torch.Tensor:
    """Scores computed as transformers' eager attentions do: soft-capped before the mask (Gemma2),
    the sink logit appended to each row's softmax and its probability dropped (GPT-OSS)."""
    import torch  # lazy: torch

    scores = torch.matmul(q, k.transpose(2, 3)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~seen, float("-inf"))
    if s_aux is not None:
        sinks = s_aux.reshape(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sinks], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if s_aux is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
