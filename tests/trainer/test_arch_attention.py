"""``sft_varlen`` computes what each architecture's eager attention computes: windows, soft-capping, sinks.

Whole-model forwards of tiny fp32 models (no quantization, no LoRA: the attention alone) on
one unpacked sequence and on a packed row of three, against transformers' eager attention
scoring each example alone: the CPU per-example path and the CUDA path's logic with the
reference kernel (``EMULATED``). Soft-capping (Gemma2, scores made large enough that
``tanh`` bites) and attention sinks (GPT-OSS) are checked here on their own, apart from the
window. The CUDA path's contract with its kernel (the caller's boundary tensor and int, the
window as ``(W - 1, 0)``) is checked by a recording kernel.
"""

from __future__ import annotations

from typing import Any

import pytest

from trainer import attention

pytestmark = pytest.mark.unit

VOCAB = 300
TOLERANCE = 1e-4   # fp32 logits; eager vs sdpa differ by ~1e-6 here, an ignored window by 0.1-1


def _model(model_type: str) -> Any:
    import torch
    import transformers as t

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  initializer_range=0.1, tie_word_embeddings=False, pad_token_id=0)
    configs = {
        "mistral": lambda: t.MistralConfig(**common, sliding_window=8),
        "gemma3_text": lambda: t.Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16,
                                                  layer_types=["sliding_attention", "full_attention"]),
        # no window, and scores ~10x the cap: only the soft-capping differs from plain attention
        "gemma2": lambda: t.Gemma2Config(**{**common, "initializer_range": 0.5}, attn_logit_softcapping=1.0,
                                         layer_types=["full_attention", "full_attention"], query_pre_attn_scalar=16),
        "gpt_oss": lambda: t.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    }
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(configs[model_type](), dtype=torch.float32).eval()
    if model_type == "gpt_oss":   # sinks large enough to take a visible share of each softmax
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "sinks"):
                    module.sinks.normal_(2.0, 1.0)
    return model


def _logits(model: Any, implementation: str, ids: list[list[int]]) -> Any:
    """Logits of the examples ``ids``: packed in one row (varlen paths), or each alone."""
    import torch

    from trainer.packing import sequence_bounds

    model.set_attn_implementation(implementation)
    with torch.no_grad():
        if implementation == "eager":
            return torch.cat([model(input_ids=torch.tensor([e]), use_cache=False).logits[0] for e in ids])
        positions = [p for e in ids for p in range(len(e))]
        bounds = sequence_bounds(positions)
        row = torch.tensor([[t for e in ids for t in e]])
        out = model(input_ids=row, position_ids=torch.tensor([positions]), use_cache=False,
                    cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32), max_length_q=max(map(len, ids)))
        return out.logits[0]


@pytest.mark.parametrize("implementation", [attention.VARLEN, attention.EMULATED])
@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text", "gemma2", "gpt_oss"])
def test_varlen_matches_eager(model_type: str, implementation: str) -> None:
    import random

    attention.register()
    attention.register_emulated()
    model = _model(model_type)
    rng = random.Random(0)
    ids = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (30, 11, 23)]
    eager = _logits(model, "eager", ids)
    for examples in (ids[:1], ids):            # one unpacked sequence, then the packed row
        got = _logits(model, implementation, examples)
        diff = float((got - eager[: got.shape[0]]).abs().max())
        print(f"\n{model_type} {implementation} {len(examples)} example(s): max |logit - eager| {diff:.1e}")
        assert diff < TOLERANCE


def test_the_feature_under_test_matters() -> None:
    """Each case above would fail without its feature: the window, the cap and the sinks change the logits."""
    import torch

    attention.register()
    ids = [list(range(1, 31))]
    for model_type, drop in (("mistral", "sliding_window"), ("gemma2", "softcap"), ("gpt_oss", "s_aux")):
        model = _model(model_type)
        eager = _logits(model, "eager", ids)

        def without(*args: Any, _drop: str = drop, **kwargs: Any) -> Any:
            kwargs.pop(_drop, None)
            return attention.varlen_attention_forward(*args, **kwargs)

        from transformers import AttentionInterface

        AttentionInterface.register("test_without", without)
        diff = float((_logits(model, "test_without", ids) - eager).abs().max())
        assert diff > 100 * TOLERANCE, f"{model_type} without {drop}: {diff}"
        assert torch.isfinite(eager).all()


def test_the_cuda_path_hands_the_callers_boundaries_to_the_kernel() -> None:
    """No host sync: the kernel gets the caller's tensor and int, untouched, and the window as (W - 1, 0)."""
    import torch

    calls: list[dict[str, Any]] = []

    def kernel(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int, **options: Any) -> Any:
        calls.append({"cu_q": cu_q, "cu_k": cu_k, "max": (max_q, max_k), **options})
        return attention.reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **options)

    query, key = torch.randn(1, 4, 30, 16), torch.randn(1, 2, 30, 16)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    for window, expected in ((None, (-1, 0)), (8, (7, 0)), (18, (-1, 0))):
        out, _ = attention.varlen_attention_forward(None, query, key, key, None, scaling=0.25, sliding_window=window,
                                                    kernel=kernel, cu_seq_lens_q=cu, max_length_q=18)
        assert out.shape == (1, 30, 4, 16)
        call = calls.pop()
        assert call["cu_q"] is cu and call["cu_k"] is cu and call["max"] == (18, 18)
        assert call["window_size"] == expected and call["enable_gqa"] and call["scale"] == 0.25


def test_window_semantics_match_transformers_masks() -> None:
    """W keys including the query itself, as transformers' sliding_window_overlay and its flash path."""
    import torch
    from transformers.masking_utils import sliding_window_causal_mask_function

    mask = sliding_window_causal_mask_function(8)
    i = torch.arange(20)
    expected = mask(torch.tensor(0), torch.tensor(0), i[:, None], i[None, :])
    assert torch.equal(attention._causal_window(20, 8, torch.device("cpu")), expected)
    assert attention.window_size(8, 20) == (7, 0) and attention.window_size(8, 8) == (-1, 0)


def test_the_reference_kernel_refuses_what_the_kernel_would_get_wrong() -> None:
    import torch

    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit"):
        attention.reference_varlen_attn(q, q, q, cu, cu, 5, 5)           # longest is 6
    with pytest.raises(ValueError, match="int32"):
        attention.reference_varlen_attn(q, q, q, cu.long(), cu.long(), 6, 6)
    with pytest.raises(ValueError, match="enable_gqa"):
        attention.reference_varlen_attn(q, q[:, :1], q[:, :1], cu, cu, 6, 6)
