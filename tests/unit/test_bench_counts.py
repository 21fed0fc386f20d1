"""The bench's fairness arithmetic: MFU's model FLOPs (bench/gpu.py) against a hand computation, and
the token count from the data (bench/trainer.py), which a pad id equal to eos cannot shrink."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import gpu as bg  # noqa: E402
from bench import trainer as bt  # noqa: E402

# 1 layer, hidden 4, 2 query heads of dim 2, 1 kv head, intermediate 8, vocab 10
SHAPE = {"hidden_size": 4, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 8, "vocab_size": 10}


def test_training_flops_match_a_hand_computation() -> None:
    # decoder weights: q 4x4 + k 4x2 + v 4x2 + o 4x4 + gate 4x8 + up 4x8 + down 8x4 = 144;
    # 5 tokens x 4 FLOPs (2 forward, 2 input gradient: the base is frozen) x 144 = 2880
    # LoRA r 1: (4+4) + (4+2) + (4+2) + (4+4) + (4+8) + (4+8) + (8+4) = 64 parameters; 5 x 6 x 64 = 1920
    # attention: examples of 2 and 3 tokens, causal pairs 3 + 6 = 9; 4 x 2 heads x dim 2 x 9 = 144 forward, x3
    # head at 3 trained positions: 4 x vocab 10 x hidden 4 x 3 = 480
    flops = bg.training_flops(SHAPE, [2, 3], trained=3, lora_r=1)
    assert flops == {"decoder": 2880, "lora": 1920, "attention": 432, "head": 480, "total": 5712, "tokens": 5}


def test_training_flops_grow_with_the_square_of_an_example_only_in_attention() -> None:
    one = bg.training_flops(SHAPE, [8], trained=4, lora_r=1)
    split = bg.training_flops(SHAPE, [4, 4], trained=4, lora_r=1)
    assert one["decoder"] == split["decoder"] and one["head"] == split["head"]
    assert one["attention"] == 3 * 4 * 2 * 2 * 36 and split["attention"] == 3 * 4 * 2 * 2 * 20


def test_mfu_on_an_8b_slice_counts_neither_embeddings_nor_the_head_at_untrained_positions() -> None:
    shape = bg.LLAMA3_8B_SLICE
    flops = bg.training_flops(shape, [1024] * 4, trained=2048, lora_r=8)
    per_token = flops["total"] / flops["tokens"]
    everything = 6 * (4 * 218_103_808 + 2 * 128256 * 4096)  # the old 6 x all parameters (4 layers, embed + head)
    assert per_token < everything / 1.5
    assert bg.mfu(per_token, 1000.0, 989e12) == pytest.approx(per_token * 1000.0 / 989e12)
    assert bg.mfu(per_token, 1000.0, None) is None


def test_decoder_weights_of_the_8b_slice_are_llama3_8b_per_layer() -> None:
    per_layer = sum(i * o for i, o in bg._decoder_linears(bg.LLAMA3_8B_SLICE))
    assert per_layer == 218_103_808  # Llama-3-8B: (8.03e9 - 2 x 128256 x 4096 - norms) / 32


def test_token_count_from_the_data_keeps_tokens_equal_to_the_pad_id() -> None:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    eos = 2
    examples = [{"input_ids": [5, 6, eos], "seq_lengths": [3]}, {"input_ids": [7, eos, 8, 9, eos], "seq_lengths": [5]}]
    collator = bt.CountingCollator(DataCollatorForLanguageModeling(pad_token_id=eos, padding_free=True))
    batch = collator(examples)
    assert collator.counts == [8]
    assert int((batch["input_ids"] != eos).sum()) == 5  # what TRL's "non_padding" count would have said


def test_step_marks_accumulate_each_steps_tokens() -> None:
    assert bt.step_marks([1.0, 2.0, 3.5], [10, 20, 5]) == [(1.0, 10), (2.0, 30), (3.5, 35)]
    assert bt._timed(bt.step_marks([1.0, 2.0, 3.5], [10, 20, 5]))["tokens_per_s"] == pytest.approx(25 / 2.5)
