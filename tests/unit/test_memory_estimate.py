"""trainer.memory (the per-rank estimate), the gateway's memory admission and rank widening, and
trainer.packing's rank check: pure functions, no model loaded."""

from __future__ import annotations

import pytest

from trainer import memory
from trainer.spec import Hyperparameters

pytestmark = pytest.mark.unit

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
           "dtype": "float32"}
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False, "dtype": "bfloat16"}
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "intermediate_size": 28672}


def test_shape_and_parameter_count_from_config() -> None:
    shape = memory.ModelShape.from_config(SMOLLM2)
    assert shape.parameters() == pytest.approx(134.5e6, rel=0.01)       # SmolLM2-135M, norms left out
    big = memory.ModelShape.from_config(LLAMA_8B)
    assert big.head_dim == 128 and not big.tied
    assert big.parameters() == pytest.approx(8.03e9, rel=0.01)          # Llama-3-8B
    with pytest.raises(ValueError, match="vocab_size"):
        memory.ModelShape.from_config({k: v for k, v in SMOLLM2.items() if k != "vocab_size"})


def test_lora_params_all_linear_and_named_modules() -> None:
    shape = memory.ModelShape.from_config(SMOLLM2)
    per_layer = 16 * ((576 + 576) + 2 * (576 + 192) + (576 + 576) + 3 * (576 + 1536))
    assert memory.lora_params(shape, 16, "all-linear") == 30 * per_layer
    assert memory.lora_params(shape, 8, ["q_proj", "v_proj"]) == 30 * 8 * ((576 + 576) + (576 + 192))


def test_terms_move_the_way_the_trainer_allocates() -> None:
    shape = memory.ModelShape.from_config(LLAMA_8B)
    base = memory.estimate(shape, max_seq_len=2048)
    assert base.total == pytest.approx(base.runtime + base.weights + base.lora_adam + base.transient
                                       + memory.STEP_OVERHEAD_BYTES["cuda"] + shape.layers * 2048 * 4096 * 4
                                       + max(base.activations - shape.layers * 2048 * 4096 * 4, base.logits), abs=8)
    assert 7.0 < base.weights / memory.GIB < 8.5          # 4-bit decoder (3.6 GiB) + fp32 embeddings and head
    longer = memory.estimate(shape, max_seq_len=8192)
    assert longer.activations > 3.5 * base.activations and longer.logits == base.logits   # chunked logits
    dpo = memory.estimate(shape, max_seq_len=2048, method="dpo")
    assert dpo.row_tokens == 4096 and dpo.activations > base.activations   # a row holds both sides
    no_ckpt = memory.estimate(shape, max_seq_len=2048, gradient_checkpointing=False)
    assert no_ckpt.activations > 10 * base.activations
    assert memory.estimate(shape, max_seq_len=2048, world_size=8).total == base.total   # data parallel: whole copy
    sharded = memory.estimate(memory.ModelShape.from_config(LLAMA_70B), max_seq_len=2048, world_size=8, fsdp=True)
    whole = memory.estimate(memory.ModelShape.from_config(LLAMA_70B), max_seq_len=2048)
    assert sharded.weights < whole.weights / 3 and sharded.lora_adam == whole.lora_adam // 8
    assert memory.estimate(shape, max_seq_len=2048, dense_mask=True).attention == 2048 * 2048
    cpu = memory.estimate(memory.ModelShape.from_config(SMOLLM2), max_seq_len=2048, device="cpu")
    assert cpu.mapped == 49152 * 576 * 4 and cpu.runtime == memory.CPU_RUNTIME_BYTES  # fp32 file: mapped


def test_logit_chunk_is_the_trainers() -> None:
    pytest.importorskip("torch")
    from trainer.model import LOGIT_CHUNK

    assert memory.LOGIT_CHUNK == LOGIT_CHUNK


def test_estimate_job_takes_the_hyperparameters() -> None:
    shape = memory.ModelShape.from_config(LLAMA_8B)
    hp = Hyperparameters(max_seq_len=4096, batch_size_tokens=8192, lora_r=64)
    est = memory.estimate_job(shape, hp)
    assert est == memory.estimate(shape, max_seq_len=4096, lora_r=64)
    assert memory.estimate_job(shape, hp, method="dpo").row_tokens == 8192
