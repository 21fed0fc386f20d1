"""Frozen embeddings and LM head in the compute dtype after peft's k-bit preparation.

peft's ``prepare_model_for_kbit_training`` upcasts them to float32; under autocast a frozen
float32 weight is cast again at every use (autocast caches casts of trainable leaves only), so
the head was re-cast for every logit chunk and every recompute. On CUDA (bfloat16 compute)
``add_lora`` casts them back; on the CPU (float32 compute) nothing changes. There is no GPU
here: the CUDA branch's cast is run on the CPU under CPU autocast (bfloat16), which casts as
CUDA's does.
"""

from __future__ import annotations

from typing import Any

import pytest
from trainer_testlib import Tiny, lora_with_random_b

pytestmark = pytest.mark.train

CHUNK = 16  # logit chunk: the 88 trained positions below make 6 chunks


def _row() -> Any:
    from trainer.packing import IGNORE, Row

    ids = [(7 * i + 3) % 2000 + 5 for i in range(96)]
    return Row(ids, list(range(48)) + list(range(48)), [IGNORE] * 8 + ids[9:] + [IGNORE])


def _lora(tiny: Tiny) -> Any:
    return lora_with_random_b(tiny.path, max_seq_len=128, gradient_checkpointing=True)


def _head_casts(model: Any) -> tuple[float, int]:
    """One training forward and backward under CPU autocast (bfloat16); return the loss and the number of
    casts of a tensor of the LM head's shape."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer.model import row_loss

    shape = list(model.get_output_embeddings().weight.shape)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _, _ = row_loss(model, _row(), chunk=CHUNK)
        loss.backward()
    casts = sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes[:1] == [shape])
    return float(loss.detach()), casts


def test_on_the_cpu_add_lora_keeps_float32(tiny: Tiny) -> None:
    import torch

    model = _lora(tiny)
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert model.get_output_embeddings().weight.dtype == torch.float32


def test_the_cuda_cast_makes_the_frozen_head_bfloat16_and_the_model_still_trains(tiny: Tiny) -> None:
    import torch

    from trainer.model import cast_frozen_embeddings

    model = _lora(tiny)
    before_loss, before_casts = _head_casts(model)
    model.zero_grad()
    cast = cast_frozen_embeddings(model, torch.bfloat16)
    assert sorted(n.rsplit(".", 2)[-2] for n in cast) == ["embed_tokens", "lm_head"]
    assert cast_frozen_embeddings(model, torch.bfloat16) == []  # idempotent
    assert model.get_input_embeddings().weight.dtype == model.get_output_embeddings().weight.dtype == torch.bfloat16
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all(p.dtype == torch.float32 for p in lora.values())  # fp32 masters
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(p.dtype == torch.float32 for p in norms)  # as peft leaves them
    after_loss, after_casts = _head_casts(model)
    print(f"\nhead casts per forward+backward ({CHUNK}-position chunks): float32 head {before_casts}, "
          f"bfloat16 head {after_casts}; loss {before_loss:.4f} -> {after_loss:.4f}")
    assert before_casts >= 6 and after_casts == 0
    assert after_loss == pytest.approx(before_loss, rel=2e-2)  # bf16 rounding only
    grads = [p.grad for p in lora.values()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0
    optimizer = torch.optim.AdamW(list(lora.values()), lr=1e-2)
    start = {n: p.detach().clone() for n, p in lora.items()}
    optimizer.step()
    assert any(not torch.equal(start[n], p) for n, p in lora.items())
    _, again = _head_casts(model)  # a second step under autocast still trains from the bf16 head
    assert again == 0


def test_a_tied_head_stays_tied_when_cast(tiny: Tiny, tmp_path: Any) -> None:
    import torch
    from fsdp_probe import deep_tiny

    from trainer.model import cast_frozen_embeddings

    tied = Tiny(tiny.root, tiny.name, tiny.digest, deep_tiny(tiny.path, tmp_path / "tied", 2))
    model = _lora(tied)
    cast = cast_frozen_embeddings(model, torch.bfloat16)
    assert len(cast) == 1
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert model.get_output_embeddings().weight.dtype == torch.bfloat16
