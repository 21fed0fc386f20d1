"""The architecture matrix: every family the catalog admits trains on packed rows as eager attention scores it.

For each verified family (``trainer.catalog.VERIFIED_FAMILIES``, checked to be exactly the families
here) a tiny random model is built offline from transformers' own config class, with a sliding
window of 8 where the family has one, and loaded and wrapped as the trainer does
(``load_base_model``: 4-bit NF4; ``add_lora``). One SFT step (``accumulate_gradients``) and one
DPO step (``row_logps`` + ``dpo_terms``, as ``accumulate_pair_gradients``) on a packed row of
examples longer than the window (20-40 tokens) are compared with the same examples scored one
per row with eager attention: loss and every LoRA gradient, on every attention path the trainer
can take: ``sft_varlen`` on the CPU (one SDPA per example), the CUDA varlen path's own logic
with torch's kernel replaced by ``trainer.attention.reference_varlen_attn`` (same cu_seqlens /
max_len / window_size contract), and the dense-mask fallback (sdpa with the block-diagonal mask
transformers derives from ``position_ids``; eager for Gemma2, which refuses sdpa). The flash
paths run only where a CUDA GPU is.

Tolerance: fp32 on the CPU. Eager against sdpa on the same unpacked rows (the noise floor of
two correct kernels) differs by at most ~1e-6 relative in the loss and ~1e-5 relative in the
gradients here; ``RTOL`` is 1e-4, 10x above that floor and far below what a wrong mask costs
(a window ignored moves the loss by 1e-2 to 1e-1 and the gradients by 10-100 %).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import Tiny

pytestmark = pytest.mark.train

WINDOW = 8
LENGTHS = (31, 20, 40, 27)      # each longer than the window; the row is 118 tokens
RTOL = 1e-4
HIDDEN = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False)


def _configs() -> dict[str, Callable[[int], Any]]:
    """model_type -> build(vocab) of a tiny config of that family."""
    import transformers as t

    def common(vocab: int, layers: int = 2, **extra: Any) -> dict[str, Any]:
        return {**HIDDEN, "vocab_size": vocab, "num_hidden_layers": layers, "pad_token_id": 0,
                "bos_token_id": None, "eos_token_id": 2, **extra}

    alternate = ["sliding_attention", "full_attention"]
    return {
        "llama": lambda v: t.LlamaConfig(**common(v)),              # also SmolLM2, the tiny model
        "mistral": lambda v: t.MistralConfig(**common(v, sliding_window=WINDOW)),
        "qwen2": lambda v: t.Qwen2Config(**common(v, 3, use_sliding_window=True, sliding_window=WINDOW,
                                                  max_window_layers=1)),
        "qwen3": lambda v: t.Qwen3Config(**common(v, 3, use_sliding_window=True, sliding_window=WINDOW,
                                                  max_window_layers=1)),
        "gemma": lambda v: t.GemmaConfig(**common(v)),
        "gemma2": lambda v: t.Gemma2Config(**common(v, sliding_window=WINDOW, layer_types=alternate,
                                                    attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                                                    query_pre_attn_scalar=16)),
        "gemma3_text": lambda v: t.Gemma3TextConfig(**common(v, 3, sliding_window=WINDOW,
                                                             layer_types=[*alternate, "sliding_attention"],
                                                             query_pre_attn_scalar=16)),
        "phi3": lambda v: t.Phi3Config(**common(v, sliding_window=WINDOW)),
        "olmo2": lambda v: t.Olmo2Config(**common(v)),
        "smollm3": lambda v: t.SmolLM3Config(**common(v, 4, use_sliding_window=True, sliding_window=WINDOW)),
    }


FAMILIES = sorted(_configs())


def build_family(model_type: str, tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """Save a tiny random model of ``model_type`` with the tokenizer of ``tokenizer_dir`` in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = _configs()[model_type](len(tokenizer))
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.config.model_type == model_type
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def examples(vocab: int, seed: int = 0) -> list[Any]:
    """Fully trained examples of ``LENGTHS`` random tokens (each longer than ``WINDOW``)."""
    from trainer.packing import Example

    rng = random.Random(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = tuple(rng.randrange(3, vocab) for _ in range(n))
        out.append(Example(ids, (0,) * 3 + (1,) * (n - 3), line=i + 1))
    return out


def lora_model(path: Path) -> Any:
    """The model at ``path`` as the trainer trains it, with a seeded non-zero LoRA B (so A has gradients)."""
    import torch

    from trainer.contract.spec import Hyperparameters
    from trainer.model import add_lora, load_base_model

    model = add_lora(load_base_model(path, "cpu"), Hyperparameters(lora_r=4, lora_alpha=8, seed=0), dropout=False)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


@contextlib.contextmanager
def attention(model: Any, implementation: str) -> Iterator[None]:
    """``model`` (peft-wrapped) runs with ``implementation`` inside the block."""
    base = model.get_base_model()
    before = base.config._attn_implementation
    base.set_attn_implementation(implementation)
    try:
        yield
    finally:
        base.set_attn_implementation(before)


def _grads(model: Any) -> dict[str, Any]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    model.zero_grad(set_to_none=True)
    return grads


def sft_step(model: Any, rows: list[Any], total: int) -> tuple[float, dict[str, Any]]:
    """The trainer's SFT step over ``rows``: (token-mean loss, LoRA gradients)."""
    from trainer.model import accumulate_gradients

    model.zero_grad(set_to_none=True)
    loss, _ = accumulate_gradients(model, rows, total)
    return loss, _grads(model)


def dpo_step_packed(model: Any, pair_row: Any, reference: Any, beta: float) -> tuple[float, dict[str, Any]]:
    """The trainer's DPO step on one row of whole pairs: (mean loss, LoRA gradients)."""
    from trainer.dpo import accumulate_pair_gradients

    model.zero_grad(set_to_none=True)
    sums = accumulate_pair_gradients(model, [pair_row], len(pair_row.pairs), reference, beta)
    return sums.loss / sums.pairs, _grads(model)


def dpo_step_unpacked(model: Any, sides: list[Any], reference: Any, beta: float) -> tuple[float, dict[str, Any]]:
    """The same DPO loss with each side scored alone (its own row): (mean loss, LoRA gradients)."""
    import torch

    from trainer.dpo import dpo_terms
    from trainer.model import row_logps
    from trainer.packing import build_row

    model.zero_grad(set_to_none=True)
    policy = torch.cat([row_logps(model, build_row([side])) for side in sides]).view(-1, 2)
    loss, _ = dpo_terms(policy, reference, beta)
    loss.mean().backward()
    return float(loss.mean().detach()), _grads(model)


def worst(loss: float, grads: dict[str, Any], ref_loss: float, ref_grads: dict[str, Any]) -> tuple[float, float]:
    """(relative loss difference, largest relative gradient difference ||g - g_ref|| / ||g_ref|| over tensors)."""
    rel = [float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items()]
    return abs(loss - ref_loss) / abs(ref_loss), max(rel)


class Family:
    """One family's model and its eager, unpacked reference SFT and DPO steps (computed once)."""

    BETA = 0.1

    def __init__(self, model_type: str, tokenizer_dir: Path, out: Path) -> None:
        import torch

        from trainer.dpo import PairRow
        from trainer.packing import build_row

        self.model_type = model_type
        self.model = lora_model(build_family(model_type, tokenizer_dir, out))
        self.examples = examples(self.model.get_input_embeddings().num_embeddings)
        self.total = sum(len(e) - 3 for e in self.examples)
        self.alone = [build_row([e]) for e in self.examples]
        self.packed = build_row(self.examples)
        self.pair_row = PairRow(self.packed, [0, 1])          # pairs (0, 1) and (2, 3), chosen first
        with attention(self.model, "eager"):
            with torch.no_grad():
                self.reference = torch.cat([self._logps(r) for r in self.alone]).view(-1, 2) + torch.tensor([1.0, -1.0])
            self.sft = sft_step(self.model, self.alone, self.total)
            self.dpo = dpo_step_unpacked(self.model, self.examples, self.reference, self.BETA)
        self.floor: tuple[float, float] | None = None
        if self.dense() == "sdpa":                       # two correct kernels on the same rows
            with attention(self.model, "sdpa"):
                self.floor = worst(*sft_step(self.model, self.alone, self.total), *self.sft)

    def _logps(self, row: Any) -> Any:
        from trainer.model import row_logps

        return row_logps(self.model, row)

    def dense(self) -> str:
        """The dense-mask fallback: sdpa, or eager where the architecture refuses sdpa (Gemma2)."""
        return "sdpa" if self.model.get_base_model()._supports_sdpa else "eager"

    def run(self, implementation: str) -> dict[str, tuple[float, float]]:
        """{"sft": ..., "dpo": ...}: the packed steps under ``implementation`` against the references."""
        with attention(self.model, implementation):
            sft = worst(*sft_step(self.model, [self.packed], self.total), *self.sft)
            dpo = worst(*dpo_step_packed(self.model, self.pair_row, self.reference, self.BETA), *self.dpo)
        return {"sft": sft, "dpo": dpo}


@pytest.fixture(scope="module")
def families(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Family]]:
    from trainer.attention import register, register_emulated

    register()
    register_emulated()
    built: dict[str, Family] = {}
    base = tmp_path_factory.mktemp("zoo")

    def get(model_type: str) -> Family:
        if model_type not in built:
            built[model_type] = Family(model_type, tiny.path, base / model_type)
        return built[model_type]

    yield get
    built.clear()


PATHS = ("sft_varlen", "sft_varlen_emulated", "dense")


def test_the_matrix_covers_exactly_the_verified_families() -> None:
    from trainer.catalog import VERIFIED_FAMILIES

    assert set(FAMILIES) == set(VERIFIED_FAMILIES)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_packed_steps_match_eager_unpacked(families: Callable[[str], Family], model_type: str, path: str) -> None:
    family = families(model_type)
    implementation = family.dense() if path == "dense" else path
    got = family.run(implementation)
    floor = "n/a" if family.floor is None else f"{max(family.floor):.1e}"
    print(f"\n{model_type:12} {implementation:20} sft loss {got['sft'][0]:.1e} grad {got['sft'][1]:.1e} | "
          f"dpo loss {got['dpo'][0]:.1e} grad {got['dpo'][1]:.1e} | eager-vs-sdpa floor {floor}")
    if family.floor is not None:
        assert max(family.floor) * 10 <= RTOL, f"the noise floor {family.floor} is too close to RTOL {RTOL}"
    for step, (loss, grad) in got.items():
        assert loss <= RTOL and grad <= RTOL, (
            f"{model_type} on {implementation}: packed {step} differs from eager unpacked "
            f"(relative loss {loss:.2e}, worst LoRA gradient {grad:.2e} > {RTOL})")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_trainers_loss_is_the_models_own(families: Callable[[str], Family], model_type: str) -> None:
    """``row_loss`` (decoder + head at trained positions for ``_PLAIN_HEAD`` families, the model's own
    forward with ``logits_to_keep`` for the others, e.g. Gemma2/3's final soft-capping) against the
    cross-entropy of the model's full forward: the references above are right, not only alike."""
    import torch
    import torch.nn.functional as F

    from trainer.model import row_loss
    from trainer.packing import IGNORE

    family = families(model_type)
    with attention(family.model, "eager"), torch.no_grad():
        for row in family.alone:
            ours, _, _ = row_loss(family.model, row)
            keep = [i for i, t in enumerate(row.targets) if t != IGNORE]
            logits = family.model(input_ids=torch.tensor([row.input_ids]), use_cache=False).logits[0, keep]
            theirs = F.cross_entropy(logits.float(), torch.tensor([row.targets[i] for i in keep]), reduction="sum")
            assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", FAMILIES)
def test_cuda_paths_match_eager_unpacked(tiny: Tiny, tmp_path: Path, model_type: str) -> None:
    """On a GPU: the path ``load_base_model`` picks there (flash_attention_2, or torch's varlen kernel)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: the flash paths (flash_attention_2, torch's varlen kernel) are not run")
    from trainer.contract.spec import Hyperparameters
    from trainer.model import add_lora, load_base_model, row_loss
    from trainer.packing import build_row

    path = build_family(model_type, tiny.path, tmp_path / model_type)
    model = add_lora(load_base_model(path, "cuda"), Hyperparameters(lora_r=4, lora_alpha=8), dropout=False)
    picked = model.get_base_model().config._attn_implementation
    rows = examples(model.get_input_embeddings().num_embeddings)
    with torch.no_grad():
        packed, n, _ = row_loss(model, build_row(rows))
        with attention(model, "eager"):
            alone = sum(float(row_loss(model, build_row([e]))[0]) for e in rows)
    print(f"\n{model_type} on {picked}: packed {float(packed) / n:.5f} vs eager unpacked {alone / n:.5f}")
    assert float(packed) / n == pytest.approx(alone / n, abs=5e-2)   # bf16 compute
