"""Tool calling (issue 34): the tool-capable template, the trained span of a tool-calling line, the
refusal of a template that ignores tools. A real job that trains one, and the before/after of the
calls its model makes, is ``tests/slurm/test_tool_calling.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from trainer_testlib import Tiny

from trainer.catalog import CHATML_TEMPLATE, CHATML_TOOLS_TEMPLATE, renders_tools
from trainer.contract.errors import DatasetError
from trainer.contract.lines import LineReader
from trainer.data import Conversation, tokenize_all, tokenize_conversation
from trainer.toydata import toy_tool_conversations

pytestmark = pytest.mark.train

PLAIN = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
         {"role": "assistant", "content": "goodbye"}]


def _tokenizer(tiny: Tiny, template: str | None = None) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.path)
    if template is not None:
        tok.chat_template = template
    return tok


def _conversation(line: dict[str, Any], number: int = 1) -> Conversation:
    chat = LineReader().read(number, json.dumps(line).encode())
    return Conversation(number, chat.conversations()[0], chat.weights, chat.tool_schemas())


def test_tools_template_renders_plain_chat_as_chatml(tiny: Tiny) -> None:
    """The tiny model's tool-capable template renders a conversation without tools byte for byte
    as plain ChatML (so every chat job trains exactly as before), and renders tools when given."""
    tok = _tokenizer(tiny)
    assert tok.chat_template == CHATML_TOOLS_TEMPLATE
    with_tools = tok.apply_chat_template(PLAIN, tokenize=False, add_generation_prompt=True)
    assert with_tools == _tokenizer(tiny, CHATML_TEMPLATE).apply_chat_template(PLAIN, tokenize=False,
                                                                                add_generation_prompt=True)
    assert renders_tools(tok) is True
    assert renders_tools(_tokenizer(tiny, CHATML_TEMPLATE)) is False      # ignores tools: refused for them


def test_trained_span_is_the_calls_and_the_answers_not_the_tool_results(tiny: Tiny) -> None:
    tok = _tokenizer(tiny)
    line = toy_tool_conversations(1, seed=5)[0]
    result = line["messages"][-2]["content"]
    example = tokenize_conversation(tok, _conversation(line), "train")
    trained = tok.decode([t for t, m in zip(example.input_ids, example.loss_mask, strict=True) if m])
    call = line["messages"][-3]["tool_calls"][0]["function"]
    rendered_call = json.dumps({"name": call["name"], "arguments": json.loads(call["arguments"])})
    assert f"<tool_call>{rendered_call}</tool_call>" in trained
    assert line["messages"][-1]["content"] in trained
    assert result not in trained and "<tools>" not in trained      # tool results and schemas: not trained
    # weight 0 on the calling message: its call is no longer trained, the final answer still is
    line["messages"][-3]["weight"] = 0
    masked = tokenize_conversation(tok, _conversation(line), "train")
    trained0 = tok.decode([t for t, m in zip(masked.input_ids, masked.loss_mask, strict=True) if m])
    assert "<tool_call>" not in trained0 and line["messages"][-1]["content"] in trained0
    assert masked.input_ids == example.input_ids


def test_prefix_fallback_masks_the_same_span(tiny: Tiny) -> None:
    """Without {% generation %} marks the trainer finds the assistant's spans by rendering prefixes:
    the same trained tokens as with the marks, tools passed to every render."""
    line = toy_tool_conversations(3, seed=6)[0]    # a plain turn, then the tool exchange
    marked = tokenize_conversation(_tokenizer(tiny), _conversation(line), "train")
    plain_tools = CHATML_TOOLS_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    unmarked = tokenize_conversation(_tokenizer(tiny, plain_tools), _conversation(line), "train")
    assert unmarked.input_ids == marked.input_ids
    # the prefix way ends a span at the end-of-turn marker, as the marks do
    assert unmarked.loss_mask == marked.loss_mask


def test_template_without_tools_is_refused_naming_line_and_model(tiny: Tiny) -> None:
    conversations = [_conversation({"messages": PLAIN}, 1), _conversation(toy_tool_conversations(1)[0], 2)]
    with pytest.raises(DatasetError) as e:
        tokenize_all(_tokenizer(tiny, CHATML_TEMPLATE), conversations, 512, "train")
    assert "train dataset line 2 declares tools" in str(e.value) and "does not render tools" in str(e.value)
    assert "get_weather" not in str(e.value)       # never the data


def test_smollm2s_real_template_renders_no_tools_so_a_tool_file_is_refused_on_it() -> None:
    """The packaged real model: SmolLM2-135M-Instruct's own chat template (as its GGUF ships it, and
    as the catalog's marked copy renders it) ignores ``tools`` and ``tool_calls``, so the probe says
    no and the trainer refuses a tool-calling file on it by name instead of training empty turns."""
    from transformers import AutoTokenizer

    from trainer.catalog import SMOLLM2_TEMPLATE, find_smollm2_gguf

    gguf = find_smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert renders_tools(tok) is False
    with pytest.raises(DatasetError, match="line 1 declares tools, but the chat template of base model"):
        tokenize_all(tok, [_conversation(toy_tool_conversations(1)[0])], 2048, "train")
    tok.chat_template = SMOLLM2_TEMPLATE
    assert renders_tools(tok) is False
