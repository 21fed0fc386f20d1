"""Variable-length attention over a packed row: each example attends to itself only, with no mask.

Registered with transformers as ``VARLEN`` (``attn_implementation="sft_varlen"``). A name
transformers has no mask function for makes it build no attention mask at all, so a packed
row never costs a dense T x T mask. The example boundaries come from the caller
(``cu_seq_lens_q``, ``max_length_q``: the same keywords transformers' flash-attention path
takes; ``trainer.model.row_loss`` passes them), else from ``position_ids`` restarting at 0.

- CUDA: ``torch.nn.attention.varlen.varlen_attn`` (flash-attention's varlen kernel, shipped
  in torch; bf16/fp16 inputs, causal by ``window_size=(-1, 0)``), one call for the row.
- CPU: one causal ``scaled_dot_product_attention`` per example: no mask, and the scores are
  sum(L_i^2) instead of T^2.

Without boundaries (a plain unpacked batch) it is ordinary causal SDPA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

VARLEN = "sft_varlen"


def register() -> str:
    """Register ``VARLEN`` with transformers (idempotent); return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    return VARLEN


def cuda_varlen_available() -> bool:
    """Whether torch ships the varlen kernel and the GPU can run it (flash attention: Ampere or newer)."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
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


def varlen_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` (1, H, T, D), ``key``/``value`` (1, H_kv, T, D);
    returns ((1, T, H, D), None).

    Raises:
        ValueError: a batch of more than one row, or a mask (both mean this is not a packed row),
            or attention dropout.
    """
    if dropout:
        raise ValueError(f"{VARLEN} has no attention dropout (got {dropout})")
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError(f"{VARLEN} runs one packed row without a mask (got batch {query.shape[0]}, "
                         f"mask {'set' if attention_mask is not None else 'none'})")
    length = query.shape[2]
    cu = kwargs.get("cu_seq_lens_q")
    bounds = [int(b) for b in cu.tolist()] if cu is not None else boundaries(kwargs.get("position_ids"), length)
    groups = query.shape[1] // key.shape[1]
    if query.is_cuda:
        out = _cuda(query, key, value, bounds, scaling, groups)
    else:
        out = _per_example(query, key, value, bounds, scaling, groups)
    return out.unsqueeze(0), None   # (1, T, H, D), as transformers' other kernels return


def _cuda(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
          scaling: float | None, groups: int) -> torch.Tensor:
    import torch
    from torch.nn.attention.varlen import varlen_attn

    half = torch.bfloat16 if query.dtype not in (torch.float16, torch.bfloat16) else query.dtype
    q, k, v = (t[0].transpose(0, 1).to(half) for t in (query, key, value))   # (T, H, D)
    cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0),
                      enable_gqa=groups > 1)
    assert isinstance(out, torch.Tensor)        # a tuple only with return_aux
    return out.to(query.dtype)


def _per_example(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
                 scaling: float | None, groups: int) -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    parts = [
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                       is_causal=True, scale=scaling)
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    return torch.cat(parts, dim=2)[0].transpose(0, 1)   # (T, H, D)
