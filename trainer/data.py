"""Chat datasets: integrity check, line validation, tokenization with loss masks.

Input is OpenAI-style chat JSONL: one ``{"messages": [...]}`` per line, roles
system/user/assistant, an optional ``weight`` (0 or 1) on assistant messages.
Lines are read by the contract's grammar (``trainer.contract.lines``), the one the
gateway validated the upload with. Errors name the dataset and the line number, never the text.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainer.catalog import renders_tools
from trainer.contract.errors import DatasetError
from trainer.contract.lines import CHAT, Chat, LineError, LineReader, Preference
from trainer.packing import Example, mask_from_spans, mask_runs

_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer this module uses."""

    chat_template: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """Render (``tokenize=False``) or tokenize ``conversation`` with the model's chat template."""
        ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Conversation:
    """One validated dataset line."""

    line: int
    messages: list[dict[str, Any]]
    weights: list[int]  # one per assistant message, in order
    tools: list[dict[str, Any]] | None = None   # the line's function schemas (``tools=`` of the template)


def sha256_file(path: str | Path) -> str:
    """Return the hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: str | Path, expected: str, what: str) -> None:
    """Check a dataset file against the sha256 pinned in the spec.

    Raises:
        DatasetError: the file is unreadable or its sha256 differs.
    """
    try:
        actual = sha256_file(path)
    except OSError as e:
        raise DatasetError(f"{what} dataset {path}: cannot read ({e.strerror})") from e
    if actual != expected:
        raise DatasetError(
            f"{what} dataset {path}: sha256 is {actual} but the spec pins {expected}; "
            "the file changed after upload - re-upload it and submit a new job"
        )


def read_lines(path: str | Path, what: str, fmt: str) -> Iterator[tuple[int, Chat | Preference]]:
    """Yield ``(line number, example)`` for every non-blank line of a dataset file of format ``fmt``
    (``trainer.contract.lines.CHAT`` or ``PREFERENCE``), read by the contract's ``LineReader``: the
    grammar the gateway validated the upload with, so a file it accepted reads here.

    Raises:
        DatasetError: the file is unreadable, or a line breaks the grammar (its message and error
            class, as the gateway reports them, after the line number; never the line's text).
    """
    reader = LineReader(fmt)
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    example = reader.read(number, raw)
                except LineError as e:
                    raise DatasetError(f"{what} dataset line {number}: {e.message} ({e.kind})") from e
                if example is not None:
                    yield number, example
    except OSError as e:
        raise DatasetError(f"{what} dataset {path}: cannot read ({e.strerror})") from e


def read_conversations(path: str | Path, what: str) -> list[Conversation]:
    """Read and validate every line of a chat JSONL file (blank lines are skipped). A message's
    ``name`` is accepted and dropped: the chat template renders role and content only (and a
    tool-calling line's calls, answers and tools, ``Chat.conversations``).

    Raises:
        DatasetError: naming the first invalid line (never its text).
    """
    conversations = []
    for number, chat in read_lines(path, what, CHAT):
        assert isinstance(chat, Chat)  # a CHAT reader reads chat lines only
        conversations.append(Conversation(number, chat.conversations()[0], chat.weights, chat.tool_schemas()))
    if not conversations:
        raise DatasetError(f"{what} dataset {path}: no examples")
    return conversations


def has_generation_marks(tokenizer: ChatTokenizer) -> bool:
    """True when the chat template marks assistant output with ``{% generation %}``."""
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_MARK.search(template))


def _encode(tokenizer: ChatTokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _prefix_length(text: str, ids: list[int], prefix: str, tokenizer: ChatTokenizer, where: str, at: str) -> int:
    """Return how many tokens of ``ids`` the rendered ``prefix`` of ``text`` covers.

    Raises:
        DatasetError: ``prefix`` is not how ``text`` begins, or its tokens are not
            how ``ids`` begins (a token straddles the boundary at ``at``).
    """
    if not text.startswith(prefix):
        raise DatasetError(
            f"{where}: the chat template does not render conversations as prefixes of "
            "each other; the base model's template needs {% generation %} marks"
        )
    prefix_ids = _encode(tokenizer, prefix)
    if ids[: len(prefix_ids)] != prefix_ids:
        raise DatasetError(
            f"{where}: tokenization drifts at the {at}: the text before it does not tokenize as "
            "a prefix of the whole conversation (a token straddles the boundary), so the trained "
            "span cannot be located; the base model's chat template needs {% generation %} marks"
        )
    return len(prefix_ids)


def _spans_by_prefix(
    tokenizer: ChatTokenizer, messages: list[dict[str, Any]], text: str, ids: list[int], where: str,
    tools: list[dict[str, Any]] | None = None,
) -> list[tuple[int, int]]:
    """Locate each assistant message of ``text`` (tokens ``ids``) by rendering up to it.

    A span starts after the generation prompt and ends with the end-of-turn
    marker itself: the whitespace the template writes after it (ChatML's
    newline) is not something the model must learn to emit. Both ends are
    checked to be token boundaries of the whole conversation.
    """
    spans = []
    n = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        n += 1
        before = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False).rstrip()
        start = _prefix_length(text, ids, before, tokenizer, where, f"start of assistant message {n}")
        end = _prefix_length(text, ids, upto, tokenizer, where, f"end of assistant message {n}")
        spans.append((start, max(start, end)))
    return spans


def model_label(tokenizer: ChatTokenizer) -> str:
    """The base model a tokenizer was loaded from: ``<name> (sha256:<12 hex>...)`` for a catalog
    copy (``<root>/<name>/<hex digest>``), else its path."""
    where = Path(str(getattr(tokenizer, "name_or_path", "") or "?"))
    if re.fullmatch(r"[0-9a-f]{64}", where.name):
        return f"{where.parent.name} (sha256:{where.name[:12]}...)"
    return str(where)


def require_chat_template(tokenizer: ChatTokenizer) -> None:
    """Refuse a tokenizer without a chat template before rendering with it (transformers would
    raise a ValueError, which the trainer reports as an internal error).

    Raises:
        DatasetError: a user error naming the model (``models add`` now refuses such a model;
            a job meets one only through an older catalog entry).
    """
    if not tokenizer.chat_template:
        raise DatasetError(
            f"base model {model_label(tokenizer)} has no chat template, so its tokenizer cannot render "
            "chat or preference data; pick a base model with one (ask the operator to register this "
            "model again with a template)"
        )


def require_tool_template(tokenizer: ChatTokenizer, conversations: list[Conversation], what: str) -> None:
    """Refuse a tool-calling file on a base model whose chat template does not render tools
    (``trainer.catalog.renders_tools``): it would train the calls as empty turns. The gateway
    refuses such a job at create; this holds for a spec that reached a node another way.

    Raises:
        DatasetError: naming the first line that declares tools, and the model.
    """
    first = next((c.line for c in conversations if c.tools), None)
    if first is not None and not renders_tools(tokenizer):
        raise DatasetError(
            f"{what} dataset line {first} declares tools, but the chat template of base model "
            f"{model_label(tokenizer)} does not render tools or tool calls; pick a base model whose "
            "template does (GET /v1/models shows capabilities.tool_calling), or leave tool calls out")


def tokenize_conversation(tokenizer: ChatTokenizer, conversation: Conversation, what: str) -> Example:
    """Tokenize with the base model's chat template; mask = trained assistant tokens.

    Raises:
        DatasetError: the model has no chat template, or it cannot be rendered for this line.
    """
    require_chat_template(tokenizer)
    where = f"{what} dataset line {conversation.line}"
    messages = conversation.messages
    if has_generation_marks(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tools=conversation.tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = list(out["input_ids"])
        mask = list(out["assistant_masks"])
        spans = mask_runs(mask)
        if len(spans) == len(conversation.weights):
            return Example(tuple(ids), tuple(mask_from_spans(len(ids), spans, conversation.weights)), conversation.line)
        if all(conversation.weights):
            return Example(tuple(ids), tuple(mask), conversation.line)
    text = tokenizer.apply_chat_template(messages, tools=conversation.tools, tokenize=False)
    ids = _encode(tokenizer, text)
    spans = _spans_by_prefix(tokenizer, messages, text, ids, where, conversation.tools)
    mask = mask_from_spans(len(ids), spans, conversation.weights)
    return Example(tuple(ids), tuple(mask), conversation.line)


def tokenize_all(
    tokenizer: ChatTokenizer, conversations: list[Conversation], max_seq_len: int, what: str
) -> list[Example]:
    """Tokenize every conversation; refuse any longer than ``max_seq_len``.

    Raises:
        DatasetError: naming the line and its token count, or the base model when the file calls
            tools and its chat template cannot render them.
    """
    require_tool_template(tokenizer, conversations, what)
    examples = []
    for conversation in conversations:
        example = tokenize_conversation(tokenizer, conversation, what)
        if len(example) > max_seq_len:
            raise DatasetError(
                f"{what} dataset line {conversation.line}: {len(example)} tokens > "
                f"max_seq_len {max_seq_len}; shorten or split that conversation, "
                "or raise hyperparameters.max_seq_len"
            )
        if not any(example.loss_mask):
            raise DatasetError(f"{what} dataset line {conversation.line}: no trained tokens")
        examples.append(example)
    return examples


def holdout_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split ``n`` example indices into (train, validation), fixed by ``seed``.

    Raises:
        DatasetError: fewer than 2 examples (nothing left to train on).
    """
    if n < 2:
        raise DatasetError(f"train dataset has {n} example(s); need >= 2 to hold some out")
    held = min(n - 1, max(1, math.ceil(n * fraction)))
    order = list(range(n))
    random.Random(seed ^ 0x5EED).shuffle(order)
    return sorted(order[held:]), sorted(order[:held])
