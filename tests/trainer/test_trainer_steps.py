"""Optimizer steps as micro-batches: bounded attention length and memory, exact accumulation, chunked logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import REPO, Tiny, ToyData, lora_with_random_b, make_spec, trainer_env, write_spec

pytestmark = pytest.mark.train

MAX_SEQ_LEN = 256
PROBE = Path(__file__).with_name("step_memory_probe.py")


def _probe(tiny: Tiny, toy: ToyData, tmp_path: Path, budget: int) -> dict[str, Any]:
    """Step 1 of a real recipe with ``batch_size_tokens=budget`` in a fresh process (peak RSS is per process)."""
    spec = make_spec(tiny, toy, tmp_path / f"job-{budget}", batch_size_tokens=budget, max_seq_len=MAX_SEQ_LEN,
                     max_steps=1, lora_dropout=0.0)
    spec["checkpoint_every_steps"] = 1000
    done = subprocess.run([sys.executable, str(PROBE), str(write_spec(spec, tmp_path / f"spec-{budget}.json"))],
                          cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_step_budget_8x_max_seq_len_trains_with_bounded_attention_and_memory(
    tiny: Tiny, toy: ToyData, tmp_path: Path
) -> None:
    small = _probe(tiny, toy, tmp_path, MAX_SEQ_LEN)
    large = _probe(tiny, toy, tmp_path, 8 * MAX_SEQ_LEN)
    step = large["metric"]
    growth = large["extra_mib"] - small["extra_mib"]
    print(f"\nstep of {step['tokens']} tokens as rows of <= {MAX_SEQ_LEN}: longest forward "
          f"{max(large['lengths'])}, loss {step['loss']:.3f}; peak RSS growth {small['extra_mib']:.1f} MiB "
          f"(1x) vs {large['extra_mib']:.1f} MiB (8x)")
    assert step["tokens"] > 7 * MAX_SEQ_LEN and step["trained_tokens"] > 0 and 0 < step["loss"] < 20
    assert max(large["lengths"]) <= MAX_SEQ_LEN
    assert len(large["lengths"]) - len(small["lengths"]) >= 8  # the extra forwards are the step's rows
    # One layer's fp32 T x T attention scores for the tiny model's 4 heads at T = 2041 are 64 MiB; the old
    # one-row step (a single 2041-token forward) grew the peak by 84 MiB here, micro-batches by about 3.
    assert growth < 32


@pytest.fixture(scope="module")
def lora_model(tiny: Tiny) -> Any:
    """The tiny base in 4-bit with LoRA (no dropout), every LoRA B non-zero so every matrix gets a gradient."""
    return lora_with_random_b(tiny.path, max_seq_len=MAX_SEQ_LEN, gradient_checkpointing=False)


@pytest.fixture(scope="module")
def examples(tiny: Tiny, toy: ToyData) -> list[Any]:
    from transformers import AutoTokenizer

    from trainer.data import read_conversations, tokenize_all

    tokenizer = AutoTokenizer.from_pretrained(tiny.path)
    return tokenize_all(tokenizer, read_conversations(toy.train, "train"), MAX_SEQ_LEN, "train")


def _grads(model: Any) -> dict[str, Any]:
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(a: dict[str, Any], b: dict[str, Any], rtol: float) -> float:
    """Every gradient of ``a`` equals ``b``'s within ``rtol`` of that tensor's largest entry; return the worst."""
    assert a.keys() == b.keys() and len(a) > 0
    worst = {k: float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a}
    for name, difference in worst.items():
        assert difference <= rtol, name
    return max(worst.values())


def test_accumulated_micro_batches_equal_one_large_batch(lora_model: Any, examples: list[Any]) -> None:
    from trainer.model import accumulate_gradients, row_loss
    from trainer.packing import build_row, micro_batches

    step = examples[:24]
    rows = micro_batches(step, 128)
    lora_model.zero_grad(set_to_none=True)
    loss, trained = accumulate_gradients(lora_model, rows)
    accumulated = _grads(lora_model)
    whole, n, _ = row_loss(lora_model, build_row(step))  # the old path: the step as one packed row
    (whole / n).backward()
    one_row = _grads(lora_model)
    worst = _assert_same_grads(accumulated, one_row, rtol=1e-4)
    mean = float(whole.detach()) / n
    print(f"\n{len(rows)} micro-batches vs one {len(build_row(step).input_ids)}-token row: loss {loss:.6f} vs "
          f"{mean:.6f}, {len(one_row)} LoRA grads, worst relative difference {worst:.2g}")
    assert len(rows) >= 4 and trained == n
    assert loss == pytest.approx(mean, rel=1e-5)


def test_chunked_logits_equal_full_logits(lora_model: Any, examples: list[Any]) -> None:
    import torch
    import torch.nn.functional as F

    from trainer.model import decoder_and_head, row_loss
    from trainer.packing import IGNORE, build_row

    assert decoder_and_head(lora_model) is not None  # the tiny Llama takes the chunked path
    row = build_row(examples[:6])
    lora_model.zero_grad(set_to_none=True)
    chunked, n, _ = row_loss(lora_model, row, chunk=7)           # several chunks: recomputed in backward
    (chunked / n).backward()
    chunked_grads = _grads(lora_model)
    lora_model.zero_grad(set_to_none=True)
    single, _, _ = row_loss(lora_model, row, chunk=10_000)        # one chunk: kept, not recomputed
    (single / n).backward()
    single_grads = _grads(lora_model)
    lora_model.zero_grad(set_to_none=True)
    keep = [i for i, t in enumerate(row.targets) if t != IGNORE]
    targets = torch.tensor([row.targets[i] for i in keep])
    out = lora_model(input_ids=torch.tensor([row.input_ids]), position_ids=torch.tensor([row.position_ids]),
                     use_cache=False)
    logits = out.logits[0, keep].float()  # every position's logits, then the trained ones
    full = F.cross_entropy(logits, targets, reduction="sum")
    (full / n).backward()
    full_grads = _grads(lora_model)
    worst = _assert_same_grads(chunked_grads, full_grads, rtol=1e-5)
    _assert_same_grads(single_grads, full_grads, rtol=1e-5)
    with torch.no_grad():                                          # evals count correct argmaxes
        _, _, correct = row_loss(lora_model, row, chunk=7)
    chunked_sum, full_sum = float(chunked.detach()), float(full.detach())
    print(f"\n{n} trained positions in chunks of 7: loss {chunked_sum:.6f} vs {full_sum:.6f}, "
          f"worst gradient difference {worst:.2g}")
    assert n == len(keep) > 7 * 3
    assert chunked_sum == pytest.approx(full_sum, rel=1e-6)
    assert int(correct) == int((logits.argmax(-1) == targets).sum())


def test_varlen_attention_equals_the_block_diagonal_mask(lora_model: Any, examples: list[Any]) -> None:
    # sft_varlen (no mask; one causal SDPA per example on the CPU) against transformers' sdpa path
    # (a dense block-diagonal mask from position_ids): same loss and gradients on a packed row
    from trainer.attention import VARLEN, boundaries
    from trainer.model import row_loss
    from trainer.packing import build_row, sequence_bounds

    base = lora_model.get_base_model()
    assert base.config._attn_implementation == VARLEN          # what load_base_model picks on the CPU
    row = build_row(examples[:7])
    lora_model.zero_grad(set_to_none=True)
    varlen, n, _ = row_loss(lora_model, row)
    (varlen / n).backward()
    varlen_grads = _grads(lora_model)
    base.set_attn_implementation("sdpa")
    try:
        masked, _, _ = row_loss(lora_model, row)
        (masked / n).backward()
        masked_grads = _grads(lora_model)
    finally:
        base.set_attn_implementation(VARLEN)
    worst = _assert_same_grads(varlen_grads, masked_grads, rtol=1e-5)
    print(f"\n{len(row.input_ids)}-token row of 7 examples: loss {float(varlen):.6f} (varlen) vs "
          f"{float(masked):.6f} (dense mask), worst gradient difference {worst:.2g}")
    assert float(varlen) == pytest.approx(float(masked), rel=1e-6)
    import torch

    assert boundaries(torch.tensor([row.position_ids]), len(row.input_ids)) == sequence_bounds(row.position_ids)
    assert boundaries(None, 5) == [0, 5]
