"""`models add` refuses a model whose packed loss differs from its unpacked loss under eager attention.

The refused architecture is a real one: OPT in transformers 5.24 reads
``position_ids`` for its learned position embeddings but builds its causal mask
without them, so packed examples attend to the examples before them (and OPT is
not a verified family, so `models add` refuses it before it is even loaded).
A sliding-window model (a tiny Mistral, window 8) is checked on probes longer
than its window, on every attention path, and an attention that drops the
window (as ``sft_varlen`` did) is refused.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from trainer_testlib import Tiny

from trainer import packcheck
from trainer.catalog import add, list_models
from trainer.contract.errors import CatalogError
from trainer.packing import IGNORE


def _tiny_opt(tiny: Tiny, out: Path) -> Path:
    """A tiny random OPT (the tiny Llama's tokenizer), built offline."""
    import torch
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny.path)
    config = OPTConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        ffn_dim=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=128,
        max_position_embeddings=2048,
        init_std=0.1,  # as wide as the tiny Llama's, so context visibly matters
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.unit
def test_probe_rows_score_one_example_each() -> None:
    examples = packcheck.probe_examples(range(10, 50))
    assert examples[2].input_ids == examples[0].input_ids  # the copy bait
    alone, packed = packcheck.probe_rows(examples)
    assert [r.n_targets for r in alone] == [r.n_targets for r in packed] == [len(e) - 1 for e in examples]
    assert packed[1].position_ids[16] == 0 and packed[1].targets[:16] == [IGNORE] * 16


@pytest.mark.unit
def test_compare_refuses_a_difference_beyond_the_dtype_tolerance() -> None:
    assert packcheck.compare("m", [3.0, 3.0], [3.0, 3.0004], "float32") == pytest.approx(4e-4)
    assert packcheck.compare("m", [3.0], [3.03], "bfloat16") == pytest.approx(0.03)
    with pytest.raises(CatalogError, match=r"does not train packed as it scores unpacked: on probe example 2 of 2 "
                       r"the packed loss 3\.2100 != unpacked 3\.0500 under eager attention .*tolerance 0\.001 "
                       r"for float32 .*ignores packed-sequence boundaries"):
        packcheck.compare("m", [3.0, 3.05], [3.0, 3.21], "float32")
    with pytest.raises(CatalogError, match="not finite"):
        packcheck.compare("m", [math.nan], [math.nan], "float32")


@pytest.mark.unit
def test_probes_are_longer_than_the_window() -> None:
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    assert packcheck.sliding_window(LlamaConfig()) is None
    assert packcheck.sliding_window(MistralConfig(sliding_window=8)) == 8
    assert packcheck.sliding_window(Qwen2Config(sliding_window=8)) is None           # use_sliding_window off
    assert packcheck.sliding_window(Gemma2Config(sliding_window=8)) == 8
    assert packcheck.sliding_window(Gemma2Config(sliding_window=8, layer_types=["full_attention"] * 26)) is None
    assert packcheck.probe_lengths(None) == (16, 12) and packcheck.probe_lengths(4096) == (4104, 12)
    assert [len(e) for e in packcheck.probe_examples(range(10, 50), window=30)] == [38, 12, 38]


@pytest.mark.train
def test_tiny_llama_passes_and_the_entry_records_the_check(tiny: Tiny, tmp_path: Path) -> None:
    entry = add(tiny.path, "tiny", tmp_path / "models")
    check = entry.packing_check
    assert check is not None and check["passed"] and check["quantization"] == "nf4"
    assert check["max_abs_diff"] < check["tolerance"] == 1e-3 and check["compute_dtype"] == "float32"
    assert check["attention"] == ["sdpa", "sft_varlen", "sft_varlen_emulated"]
    assert check["reference"].startswith("eager")
    assert check["sliding_window"] is None and check["probe_lengths"] == [16, 12]
    assert list_models(tmp_path / "models")[0].packing_check == check


@pytest.mark.train
def test_opt_is_refused_as_unverified_and_leaves_nothing_in_the_catalog(tiny: Tiny, tmp_path: Path) -> None:
    from trainer.cli import models

    opt = _tiny_opt(tiny, tmp_path / "opt")
    root = tmp_path / "models"
    res = CliRunner().invoke(models, ["add", str(opt), "--name", "opt", "--root", str(root)])
    assert res.exit_code == 1
    assert "error: model opt: architecture 'opt' is not verified for packed training here (verified: " in res.output
    assert ("gemma, gemma2, gemma3_text, llama, mistral, olmo2, phi3, qwen2, qwen3, smollm3); it is refused "
            "rather than guessed") in res.output
    assert list_models(root) == [] and sorted(p.name for p in root.iterdir()) == [".lock"]


@pytest.mark.train
def test_the_check_itself_sees_that_opt_ignores_packed_boundaries(tiny: Tiny, tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match=r"model opt \(attention sdpa\) does not train packed as it scores "
                       r"unpacked: on probe example 2 of 3 .*cannot be trained with padding-free packing"):
        packcheck.check_packing(_tiny_opt(tiny, tmp_path / "opt"), "opt")


def _tiny_mistral(tiny: Tiny, out: Path) -> Path:
    from test_arch_matrix import build_family

    return build_family("mistral", tiny.path, out)


@pytest.mark.train
def test_a_sliding_window_model_is_checked_beyond_its_window(tiny: Tiny, tmp_path: Path) -> None:
    check = add(_tiny_mistral(tiny, tmp_path / "mistral"), "mistral", tmp_path / "models").packing_check
    assert check is not None and check["sliding_window"] == 8 and check["probe_lengths"] == [16, 12]
    assert sorted(check["diffs"]) == check["attention"] == ["sdpa", "sft_varlen", "sft_varlen_emulated"]
    assert check["max_abs_diff"] < 1e-4


@pytest.mark.train
def test_an_attention_that_drops_the_window_is_refused(tiny: Tiny, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """sft_varlen as it was: the ``sliding_window`` transformers passes is dropped."""
    from typing import Any

    from trainer import attention

    real = attention.varlen_attention_forward

    def windowless(*args: Any, sliding_window: int | None = None, **kwargs: Any) -> Any:
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "varlen_attention_forward", windowless)
    try:
        with pytest.raises(CatalogError, match=r"model mistral \(attention sft_varlen\) does not train packed as "
                           r"it scores unpacked: on probe example 1 of 3"):
            packcheck.check_packing(_tiny_mistral(tiny, tmp_path / "mistral"), "mistral")
    finally:
        monkeypatch.undo()
        attention.register()
        attention.register_emulated()


@pytest.mark.train
def test_unloadable_model_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "m"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"x" * 10)
    with pytest.raises(CatalogError, match="model m: cannot be loaded as the trainer loads it"):
        add(src, "m", tmp_path / "models")
    assert list_models(tmp_path / "models") == []


@pytest.mark.train
def test_without_bitsandbytes_the_check_runs_unquantized(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packcheck, "_has_bitsandbytes", lambda: False)
    check = packcheck.check_packing(tiny.path, "tiny")
    assert check["quantization"] is None and check["max_abs_diff"] < 1e-3
