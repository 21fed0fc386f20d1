"""Model pieces of the recipe: 4-bit loading, LoRA, the packed-row loss, eval.

Torch and the Hugging Face stack are imported inside the functions so that
``trainer`` modules stay importable (and fail fast) without them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.packing import IGNORE, Example, Row, build_row, pack
from trainer.spec import Hyperparameters

if TYPE_CHECKING:
    import torch


def load_base_model(path: str | Path) -> Any:
    """Load a base model in 4-bit NF4 (double quant) on CUDA when present, else CPU.

    Applies the bitsandbytes AVX512-BF16 workaround (see ``disable_cpu_repack``).
    """
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cuda = torch.cuda.is_available()
    compute = torch.bfloat16 if cuda else torch.float32
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=compute, device_map={"": 0} if cuda else "cpu"
    )
    disable_cpu_repack(model)
    return model


def disable_cpu_repack(model: Any) -> int:
    """Stop bnb from repacking 4-bit weights for inference on AVX512-BF16 CPUs.

    bnb 0.49-0.50 repacks a ``Linear4bit`` the first time it runs in eval mode
    without grad and never undoes it; LoRA gradients are silently wrong after
    any eval pass. Returns the number of layers patched.
    """
    import bitsandbytes as bnb

    patched = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            patched += 1
    return patched


def add_lora(model: Any, hp: Hyperparameters) -> Any:
    """Prepare a k-bit model for training and wrap it with LoRA (seeded init)."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=hp.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    torch.manual_seed(hp.seed)
    config = LoraConfig(
        r=hp.lora_r,
        lora_alpha=hp.lora_alpha,
        lora_dropout=hp.lora_dropout,
        target_modules=hp.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def row_loss(model: Any, row: Row) -> tuple[torch.Tensor, int, int]:
    """Forward one packed row; return (summed loss, trained tokens, correct argmax).

    No attention mask and no cache: with per-example ``position_ids`` that makes
    transformers use a block-diagonal causal mask. Logits are computed only at
    trained positions (``logits_to_keep``).
    """
    import torch
    import torch.nn.functional as F

    device = next(p.device for p in model.parameters())
    keep = [i for i, t in enumerate(row.targets) if t != IGNORE]
    ids = torch.tensor([row.input_ids], device=device)
    positions = torch.tensor([row.position_ids], device=device)
    keep_t = torch.tensor(keep, device=device)
    targets = torch.tensor([row.targets[i] for i in keep], device=device)
    out = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep_t)
    logits = out.logits[0].float()
    loss = F.cross_entropy(logits, targets, reduction="sum")
    correct = int((logits.detach().argmax(-1) == targets).sum())
    return loss, len(keep), correct


def evaluate(
    model: Any, examples: list[Example], capacity: int, check: Callable[[], None] | None = None
) -> dict[str, float]:
    """Token-weighted loss, perplexity and token accuracy over ``examples``."""
    import torch

    rows = pack([len(e) for e in examples], list(range(len(examples))), capacity)
    total, tokens, correct = 0.0, 0, 0
    model.eval()
    try:
        with torch.no_grad():
            for indices in rows:
                if check is not None:
                    check()  # lets a signal interrupt a long eval
                loss, n, ok = row_loss(model, build_row([examples[i] for i in indices]))
                total, tokens, correct = total + float(loss), tokens + n, correct + ok
    finally:
        model.train()
    mean = total / max(tokens, 1)
    return {
        "loss": mean,
        "perplexity": math.exp(min(mean, 50.0)),
        "token_accuracy": correct / max(tokens, 1),
        "tokens": tokens,
        "examples": len(examples),
    }


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """Return the trainable (LoRA) parameters by name, detached on CPU."""
    return {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad}


def lr_lambda(warmup: int, total: int) -> Any:
    """Linear warmup over ``warmup`` steps, then linear decay to 0 at ``total``.

    ``warmup`` comes from ``Hyperparameters.warmup_for(total)`` (``warmup_steps`` or
    ``warmup_ratio``). Returns the ``LambdaLR`` factor function.
    """

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor
