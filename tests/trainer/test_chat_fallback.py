"""The loss mask built by rendering prefixes (templates without {% generation %} marks); no template at all
is refused at `models add` and fails a job as a user error naming the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import Tiny, ToyData, events, make_spec, run_trainer, write_spec

from trainer.catalog import CHATML_TEMPLATE
from trainer.contract.errors import DatasetError
from trainer.data import Conversation, has_generation_marks, tokenize_conversation
from trainer.packing import mask_runs

pytestmark = pytest.mark.unit

PLAIN_CHATML = CHATML_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONV = Conversation(
    7,
    [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "the apple and the river"},
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": "blue stone count 12."},
    ],
    [1, 1],
)


def _tokenizer(tiny: Tiny, template: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.path)
    tokenizer.chat_template = template
    return tokenizer


def test_trained_span_ends_at_the_end_of_turn_marker_not_the_newline(tiny: Tiny) -> None:
    tokenizer = _tokenizer(tiny, PLAIN_CHATML)
    assert not has_generation_marks(tokenizer)
    example = tokenize_conversation(tokenizer, CONV, "train")
    im_end, newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer("\n")["input_ids"]
    runs = mask_runs(example.loss_mask)
    trained = [tokenizer.decode(example.input_ids[s:e]) for s, e in runs]
    assert trained == ["the apple and the river<|im_end|>", "blue stone count 12.<|im_end|>"]
    for _, end in runs:
        assert example.input_ids[end - 1] == im_end
        assert [example.input_ids[end]] == newline and example.loss_mask[end] == 0
    marked = tokenize_conversation(_tokenizer(tiny, CHATML_TEMPLATE), CONV, "train")
    assert marked == example  # same tokens and mask as the template's own generation marks


def _merging_tokenizer(template: str) -> Any:
    """A real fast tokenizer without pre-tokenization whose BPE merges "\\n" + "t" into one token."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("".join(m["content"] for m in CONV.messages) + "userassistant\n"))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["\nt"] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("\n", "t")]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = template
    return tokenizer


def test_drift_at_the_start_of_the_span_is_refused() -> None:
    tokenizer = _merging_tokenizer(PLAIN_CHATML)
    text = tokenizer.apply_chat_template(CONV.messages, tokenize=False)
    assert "\nt" in tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])  # "assistant\n" + "the"
    with pytest.raises(DatasetError, match=r"train dataset line 7: tokenization drifts at the start of "
                       r"assistant message 1: .*needs \{% generation %\} marks"):
        tokenize_conversation(tokenizer, CONV, "train")


def _without_template(tiny: Tiny, out: Path) -> Path:
    """A copy of the tiny model whose tokenizer has no chat template (as some base checkpoints ship)."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(tiny.path, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template is None
    return out


def test_models_add_refuses_a_tokenizer_without_a_chat_template(tiny: Tiny, tmp_path: Path) -> None:
    from trainer.catalog import add, list_models
    from trainer.contract.errors import CatalogError

    source = _without_template(tiny, tmp_path / "plain")
    with pytest.raises(CatalogError, match=r"model plain: its tokenizer has no chat template"):
        add(source, "plain", tmp_path / "models")
    assert list_models(tmp_path / "models") == []


@pytest.mark.train
def test_a_job_meeting_a_model_without_a_chat_template_fails_as_a_user_error(
    tiny: Tiny, toy: ToyData, tmp_path: Path
) -> None:
    from trainer.catalog import add
    from trainer.contract import exitcodes

    root = tmp_path / "models"
    entry = add(_without_template(tiny, tmp_path / "plain"), "plain", root, check=None)  # an entry from before the rule
    model = Tiny(root, entry.name, entry.digest, root / entry.path)
    spec = make_spec(model, toy, tmp_path / "job")
    rc = run_trainer(write_spec(spec, tmp_path / "spec.json"), tmp_path / "log")
    log = (tmp_path / "log").read_text()
    failed = [e for e in events(tmp_path / "job") if e["type"] == "failed"]
    assert rc == exitcodes.USER_ERROR, log[-2000:]
    assert len(failed) == 1 and failed[0]["reason"] == "user_error" and failed[0]["error"] == "DatasetError"
    assert f"base model plain (sha256:{entry.digest.removeprefix('sha256:')[:12]}...) has no chat template" in (
        failed[0]["message"])
    assert "message withheld" not in log
