"""Real training on the tiny model: learning, adapter reload, packing, the bnb eval trap."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import CANARY, Reference, Tiny, ToyData, losses

pytestmark = pytest.mark.train

STAGING_LAYOUT = {
    "COMPLETE",
    "adapter_config.json",
    "adapter_model.safetensors",
    "chat_template.jinja",
    "eval.json",
    "manifest.json",
    "metrics.jsonl",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _val_examples(tokenizer_dir: Path, toy: ToyData) -> list[Any]:
    from transformers import AutoTokenizer

    from trainer.data import read_conversations, tokenize_all

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenize_all(tokenizer, read_conversations(toy.val, "validation"), 256, "validation")


@pytest.fixture(scope="module")
def lora_model(tiny: Tiny) -> Any:
    """The tiny base in 4-bit with a LoRA adapter (no dropout), in this process."""
    from trainer.contract.spec import Hyperparameters
    from trainer.model import add_lora, load_base_model

    hp = Hyperparameters(
        lora_r=8, lora_alpha=16, lora_dropout=0.0, batch_size_tokens=512, max_seq_len=256, gradient_checkpointing=False
    )
    return add_lora(load_base_model(tiny.path), hp)


def test_reference_run_learns_and_writes_staging(reference: Reference) -> None:
    print(f"\nreference run: {reference.seconds:.1f} s")
    assert reference.rc == 0, reference.log.read_text()[-3000:]
    assert {p.name for p in reference.staging.iterdir()} == STAGING_LAYOUT
    evals = json.loads((reference.staging / "eval.json").read_text())
    before, after = evals["before"]["loss"], evals["after"]["loss"]
    print(f"held-out loss {before:.3f} -> {after:.3f}, accuracy {evals['after']['token_accuracy']:.2f}")
    assert after < before - 1.5
    assert evals["after"]["perplexity"] < evals["before"]["perplexity"]
    manifest = json.loads((reference.staging / "manifest.json").read_text())
    for name, digest in manifest["files"].items():
        actual = hashlib.sha256((reference.staging / name).read_bytes()).hexdigest()
        assert digest == f"sha256:{actual}", name
    assert manifest["base_model"]["digest"] == reference.spec["base_model"]["digest"]
    assert manifest["datasets"]["train"] == reference.spec["train"]["sha256"]
    steps = losses(reference.staging)
    assert [s for s, _ in steps] == list(range(1, manifest["steps"] + 1))
    kinds = [e["type"] for e in _events(reference.job_dir)]
    assert kinds[0] == "start" and kinds[-1] == "done" and "checkpoint" in kinds


def _events(job_dir: Path) -> list[dict[str, Any]]:
    from trainer.events import read_events

    return read_events(job_dir / "events.jsonl")


def test_canary_never_reaches_logs_events_or_metrics(reference: Reference) -> None:
    places = [
        reference.log,
        reference.job_dir / "events.jsonl",
        reference.staging / "metrics.jsonl",
        reference.staging / "eval.json",
        reference.staging / "manifest.json",
    ]
    places += [p for p in (reference.job_dir / "checkpoints").rglob("*.json")]
    for path in places:
        assert CANARY not in path.read_text(errors="replace"), path
    assert "repeat:" not in reference.log.read_text()  # no dataset text at all


def test_saved_adapter_reproduces_final_eval(reference: Reference, tiny: Tiny, toy: ToyData) -> None:
    from peft import PeftModel

    from trainer.model import disable_cpu_repack, evaluate, load_base_model

    base = load_base_model(tiny.path)
    model = PeftModel.from_pretrained(base, reference.staging)
    disable_cpu_repack(model)
    result = evaluate(model, _val_examples(reference.staging, toy), reference.spec["hyperparameters"]["max_seq_len"])
    expected = json.loads((reference.staging / "eval.json").read_text())["after"]
    print(f"\nreloaded adapter eval loss {result['loss']:.6f} vs recorded {expected['loss']:.6f}")
    assert result["tokens"] == expected["tokens"]
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-4)


def test_packed_loss_equals_unpacked(lora_model: Any, tiny: Tiny, toy: ToyData) -> None:
    import torch

    from trainer.model import row_loss
    from trainer.packing import Row, build_row

    examples = _val_examples(tiny.path, toy)[:6]
    lora_model.eval()
    with torch.no_grad():
        packed, n_packed, _ = row_loss(lora_model, build_row(examples))
        alone = [row_loss(lora_model, build_row([e])) for e in examples]
    n_alone = sum(n for _, n, _ in alone)
    total_alone = sum(float(loss) for loss, _, _ in alone)
    print(f"\npacked {float(packed) / n_packed:.6f} vs unpacked {total_alone / n_alone:.6f}")
    assert n_packed == n_alone
    assert float(packed) / n_packed == pytest.approx(total_alone / n_alone, rel=1e-5)
    # control: without per-example positions the examples leak into each other
    row = build_row(examples)
    leaky = Row(row.input_ids, list(range(len(row.input_ids))), row.targets)
    with torch.no_grad():
        mixed, _, _ = row_loss(lora_model, leaky)
    print(f"positions not reset: {float(mixed) / n_packed:.6f}")
    assert abs(float(mixed) - float(packed)) / float(packed) > 1e-3


def _lora_grads(model: Any, row: Any) -> dict[str, Any]:
    from trainer.model import row_loss

    model.train()
    model.zero_grad(set_to_none=True)
    loss, n, _ = row_loss(model, row)
    (loss / n).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_lora_gradients_unchanged_by_an_eval_pass(lora_model: Any, tiny: Tiny, toy: ToyData) -> None:
    import bitsandbytes as bnb
    import torch
    from bitsandbytes.functional import has_avx512bf16

    from trainer.model import evaluate
    from trainer.packing import build_row

    layers = [m for m in lora_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    print(f"\nCPU has AVX512-BF16 (the trap's precondition): {bool(has_avx512bf16())}")
    torch.manual_seed(1)
    with torch.no_grad():  # non-zero B so every LoRA matrix gets a gradient
        for name, p in lora_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    examples = _val_examples(tiny.path, toy)
    row = build_row(examples[:4])
    before = _lora_grads(lora_model, row)
    evaluate(lora_model, examples, 512)  # the pass that triggers bnb's repack trap
    after = _lora_grads(lora_model, row)
    assert len(before) == len(after) > 0
    worst = max(float((before[k] - after[k]).abs().max()) for k in before)
    print(f"{len(before)} LoRA gradients, max abs difference after eval: {worst:.3g}")
    for name in before:
        assert torch.allclose(before[name], after[name], rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("marks", [True, False], ids=["generation-marks", "prefix-fallback"])
def test_loss_mask_covers_only_weighted_assistant_turns(tiny: Tiny, marks: bool) -> None:
    from transformers import AutoTokenizer

    from trainer.data import Conversation, has_generation_marks, tokenize_conversation

    tokenizer = AutoTokenizer.from_pretrained(tiny.path)
    if not marks:
        tokenizer.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace(
            "{% endgeneration %}", ""
        )
    assert has_generation_marks(tokenizer) is marks
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "repeat: apple"},
        {"role": "assistant", "content": "river stone"},  # weight 0: no loss
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "apple"},
    ]
    example = tokenize_conversation(tokenizer, Conversation(7, messages, [0, 1]), "train")
    trained = str(tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask, strict=True) if m]))
    assert trained.strip() == "apple<|im_end|>"
