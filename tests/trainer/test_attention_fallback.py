"""Loading falls back along sft_varlen -> sdpa -> eager when an architecture refuses a path.

A GPU without the varlen kernel picks sdpa (``trainer.model.attention_implementation``); Gemma2
refuses sdpa (its soft-capping), and the trainer must then load it with eager, the reference
every path is checked against, rather than fail the job. The choice is forced here as such a
GPU host would make it; the model, the 4-bit load and the refusal are real.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_arch_matrix import build_family
from trainer_testlib import Tiny

pytestmark = pytest.mark.train


@pytest.mark.parametrize(("model_type", "picked", "loaded"), [
    ("gemma2", "sdpa", "eager"),       # refuses sdpa: eager
    ("mistral", "sdpa", "sdpa"),       # takes what was picked
])
def test_an_architecture_refusing_the_picked_attention_loads_with_the_next(
    tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_type: str, picked: str, loaded: str
) -> None:
    import trainer.model as model_module

    path = build_family(model_type, tiny.path, tmp_path / model_type)
    monkeypatch.setattr(model_module, "attention_implementation", lambda device, max_seq_len: picked)
    model = model_module.load_base_model(path, "cpu")
    assert model.config._attn_implementation == loaded
