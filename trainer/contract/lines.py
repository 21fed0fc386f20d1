"""The JSONL line grammar of fine-tuning datasets: the one both the gateway and the trainer read.

The gateway's upload validator (``gateway.datasets.validation``) and the trainer's dataset readers
(``trainer.data.read_conversations``, ``trainer.dpo.read_pairs``) read a file's lines with the
same :class:`LineReader`, so a line one side accepts the other accepts, to the same messages and
weights, and a line one side refuses the other refuses with the same :class:`Kind` (and message,
but for where a file's format came from: ``tests/unit/test_contract_lines.py`` drives both sides
with generated lines). Each side once had
its own grammar and they drifted: the gateway accepted a ``name`` the trainer refused, and the
trainer skipped the role order, so an upload reported ``processed`` failed its job as a user error.

A file holds one of two formats, set by its first line that is a JSON object with either
format's keys (or given by the reader: the trainer knows its method):

- chat, OpenAI's chat fine-tuning format: ``{"messages": [...]}``, an optional system message
  first, then user and assistant alternating; a message holds ``role`` and ``content`` (a string),
  an optional ``weight`` (0 or 1, assistant messages only; 0: not trained on) and an optional
  ``name``; at least one assistant message has weight 1;
- preference, OpenAI's DPO format: ``{"input": {"messages": [...]}, "preferred_output":
  [assistant message], "non_preferred_output": [assistant message]}``; the prompt follows the
  chat rules without weights and ends with the user message both outputs answer; the outputs
  hold non-empty, different contents.

``name``: OpenAI's format allows an optional participant name (a string) on any message. It is
accepted and kept on :class:`Message`, but nothing renders it: the trainer's chat template and
the gateway's token counts see role and content only (:meth:`Message.turn`), so a name changes
neither what is trained nor the length checks. (Chat templates disagree on names: most drop
them, a few print them; rendering none is the one behaviour the same on every base model.)

Reading: a line is decoded straight into :class:`Message` objects by pydantic (strict, no
unknown keys) and then checked by the rules below; a line pydantic refuses, or that the rules
refuse, is read again by the detailed checks, which name its first problem. Both ways end in the
same rule functions (``_chat``, ``_pair`` and what they call), so the fast way cannot accept what
the detailed way refuses; ``tests/unit/test_contract_lines.py`` checks that too.

Error messages never quote the dataset (not even key names or role values): the gateway stores
and shows them as metadata, the trainer writes them to the job's events. Standard library and
pydantic only: the gateway imports this without torch, a compute node without the gateway.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal, get_args

from pydantic import BeforeValidator, ConfigDict, TypeAdapter, ValidationError

from trainer.contract.errors import DatasetError

# the JSON shapes below, checked by pydantic in one pass (the fast path of LineReader.read)
_STRICT = ConfigDict(extra="forbid", strict=True)


def _not_null(value: Any) -> Any:
    """Refuse a JSON null where a key is optional: pydantic would read it as the key's absence
    (None), which the grammar does not (``"weight": null`` is a ``bad_weight``)."""
    if value is None:
        raise ValueError("null")
    return value


_GIVEN = BeforeValidator(_not_null)  # runs only when the key is there


class Kind(StrEnum):
    """Error classes (the codes the gateway reports and the trainer's messages end with); each
    makes the file unusable for training. The first five are the gateway's checks beyond the
    grammar: the file's size and example count, a line's bytes and an example's tokens."""

    EMPTY_FILE = "empty_file"
    TOO_LARGE = "file_too_large"
    LINE_TOO_LONG = "line_too_long"
    TOO_FEW = "too_few_examples"
    TOO_LONG = "example_too_long"
    NOT_UTF8 = "not_utf8"
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    MISSING_MESSAGES = "missing_messages"
    MESSAGE_NOT_OBJECT = "message_not_object"
    UNKNOWN_KEY = "unknown_key"
    BAD_ROLE = "bad_role"
    BAD_CONTENT = "bad_content"
    BAD_NAME = "bad_name"
    ROLE_ORDER = "role_order"
    NO_ASSISTANT = "no_assistant"
    BAD_WEIGHT = "bad_weight"
    MISSING_SIDE = "missing_side"
    IDENTICAL_SIDES = "identical_sides"
    BAD_OUTPUT = "bad_output"
    MIXED_FORMAT = "mixed_format"


CHAT, PREFERENCE = "chat", "preference"
Role = Literal["system", "user", "assistant"]
ROLES: tuple[str, ...] = get_args(Role)
TOP_KEYS = frozenset({"messages"})
MESSAGE_KEYS = frozenset({"role", "content", "weight", "name"})
PROMPT_KEYS = MESSAGE_KEYS - {"weight"}
PAIR_KEYS = frozenset({"input", "preferred_output", "non_preferred_output"})
INPUT_KEYS = frozenset({"messages"})
TOOL_KEYS = frozenset({"tools", "parallel_tool_calls"})
OUTPUT_KEYS = frozenset({"role", "content"})
SIDES = ("preferred_output", "non_preferred_output")
_HOLDS = {CHAT: "'messages'", PREFERENCE: "'input', 'preferred_output' and 'non_preferred_output'"}


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a valid line. ``weight`` is None when the line gives none (an assistant
    message is then trained on); ``name`` is kept but never rendered (see the module's docstring)."""

    role: Role
    content: str
    weight: Annotated[int | None, _GIVEN] = None
    name: Annotated[str | None, _GIVEN] = None
    __pydantic_config__ = _STRICT

    def turn(self) -> dict[str, str]:
        """The message as a chat template renders it: role and content only."""
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class Chat:
    """A valid chat line."""

    messages: tuple[Message, ...]
    __pydantic_config__ = _STRICT

    @property
    def weights(self) -> list[int]:
        """One weight per assistant message, in order (1 where the line gives none)."""
        return [1 if m.weight is None else m.weight for m in self.messages if m.role == "assistant"]

    @property
    def chars(self) -> int:
        """Characters of content."""
        return sum(len(m.content) for m in self.messages)

    def conversations(self) -> list[list[dict[str, str]]]:
        """The one sequence a step trains on, as the chat template renders it."""
        return [[m.turn() for m in self.messages]]


@dataclass(frozen=True, slots=True)
class Preference:
    """A valid preference line: the prompt's messages and the contents of both answers."""

    prompt: tuple[Message, ...]
    chosen: str
    rejected: str

    @property
    def chars(self) -> int:
        """Characters of content: the prompt's and its shorter side's."""
        return sum(len(m.content) for m in self.prompt) + min(len(self.chosen), len(self.rejected))

    def conversations(self) -> list[list[dict[str, str]]]:
        """The two sequences a DPO step trains on: prompt + chosen, then prompt + rejected."""
        turns = [m.turn() for m in self.prompt]
        return [[*turns, {"role": "assistant", "content": side}] for side in (self.chosen, self.rejected)]


Example = Chat | Preference


class LineError(DatasetError):
    """A line the grammar refuses: its error class and a message that names the problem, never
    the data. The trainer prefixes the file and line; the gateway stores both beside the line."""

    def __init__(self, kind: Kind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True, slots=True)
class _Input:
    messages: tuple[Message, ...]
    __pydantic_config__ = _STRICT


@dataclass(frozen=True, slots=True)
class _Output:
    role: Literal["assistant"]
    content: str
    __pydantic_config__ = _STRICT


@dataclass(frozen=True, slots=True)
class _PairLine:
    input: _Input
    preferred_output: tuple[_Output, ...]
    non_preferred_output: tuple[_Output, ...]
    __pydantic_config__ = _STRICT


_FAST_CHAT = TypeAdapter(Chat)
_FAST_PAIR = TypeAdapter(_PairLine)


class LineReader:
    """Reads one file's lines in order: each to its example, None for a blank line, or a
    :class:`LineError`. The file's format is ``fmt`` when given (the trainer's method reads one),
    else set by the first line that is a JSON object with either format's keys; a line of the
    other format is a ``mixed_format`` error."""

    def __init__(self, fmt: str | None = None):
        self.format = fmt
        self.format_line: int | None = None

    def read(self, lineno: int, raw: bytes) -> Example | None:
        """The example of line ``lineno`` (``raw``, its newline or not), or None if it is blank.

        Raises:
            LineError: the line's first problem.
        """
        raw = raw.rstrip(b"\r\n")
        if not raw or raw.isspace():
            return None
        example = _fast(raw, self.format)
        if example is not None:
            read_as = PREFERENCE if isinstance(example, Preference) else CHAT
            if read_as != self.format:
                self._set_format(lineno, read_as)
            return example
        obj = decode(raw)
        fmt = format_of(obj)
        if fmt is not None:
            self._set_format(lineno, fmt)
        example = check_pair(obj) if self.format == PREFERENCE else check_example(obj)
        # JSON may escape a lone UTF-16 surrogate (\ud800), which no tokenizer can encode
        if (b"\\ud" in raw or b"\\uD" in raw) and not _encodable(example):
            raise LineError(Kind.NOT_UTF8, "a string holds a lone surrogate escape (\\ud800-\\udfff): "
                            "not valid Unicode")
        return example

    def _set_format(self, lineno: int, fmt: str) -> None:
        if self.format is None:
            self.format, self.format_line = fmt, lineno
        elif fmt != self.format:
            why = (f"the format was set by line {self.format_line}" if self.format_line is not None
                   else f"the job's method reads {self.format} examples, which hold {_HOLDS[self.format]}")
            raise LineError(Kind.MIXED_FORMAT, f"a {fmt} example in a {self.format} file ({why}); "
                            "a file holds one format only")


def _fast(raw: bytes, fmt: str | None) -> Example | None:
    """The example of a well-formed line of the file's format (a chat line when it has none yet),
    decoded by pydantic and passed by the same rules as the detailed checks; None for any other
    line (the detailed checks then find and name its problem). pydantic refuses a lone surrogate
    escape, so what it accepts needs no surrogate check."""
    try:
        if fmt != PREFERENCE:
            chat = _FAST_CHAT.validate_json(raw)
            return _chat(chat.messages) if chat.messages else None
        line = _FAST_PAIR.validate_json(raw)
        chosen, rejected = line.preferred_output, line.non_preferred_output
        if not line.input.messages or len(chosen) != 1 or len(rejected) != 1:
            return None
        return _pair(line.input.messages, _check_answer(SIDES[0], chosen[0].content),
                     _check_answer(SIDES[1], rejected[0].content))
    except (ValidationError, LineError):
        return None


def decode(raw: bytes) -> Any:
    """The JSON value of one line's bytes.

    Raises:
        LineError: the bytes are not UTF-8 (``not_utf8``) or not JSON (``not_json``).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError(Kind.NOT_UTF8, f"invalid UTF-8 at byte {e.start + 1} of the line") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(Kind.NOT_JSON, f"not valid JSON: {e.msg} at column {e.colno}") from e
    except RecursionError as e:
        raise LineError(Kind.NOT_JSON, "not valid JSON: nested too deeply") from e
    except ValueError as e:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
        raise LineError(Kind.NOT_JSON, "not valid JSON: a number with too many digits") from e


def format_of(obj: Any) -> str | None:
    """The format a parsed line is written in (``"chat"`` or ``"preference"``), or None
    when it is not an object or holds neither format's keys."""
    if not isinstance(obj, dict):
        return None
    if "messages" in obj:
        return CHAT
    return PREFERENCE if obj.keys() & PAIR_KEYS else None


def _encodable(example: Example) -> bool:
    """Whether every string of the example is valid Unicode (no lone surrogates)."""
    messages = example.messages if isinstance(example, Chat) else example.prompt
    strings = [s for m in messages for s in (m.content, m.name) if s is not None]
    if isinstance(example, Preference):
        strings += [example.chosen, example.rejected]
    try:
        for s in strings:
            s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ----------------------------------------------------------------- the rules, for both ways


def _check_weight(at: str, role: str, w: Any, weights: bool) -> None:
    """A message's ``weight`` (present): only on assistant messages, 0 or 1, none in a prompt."""
    if not weights:
        raise LineError(Kind.BAD_WEIGHT, f"{at} has a weight; a preference prompt takes no "
                        "weights (the two outputs are what is learned)")
    if role != "assistant":
        raise LineError(Kind.BAD_WEIGHT, f"{at} has a weight but is a {role} "
                        "message; only assistant messages take a weight")
    if isinstance(w, bool) or w not in (0, 1):
        raise LineError(Kind.BAD_WEIGHT, f"{at}.weight must be 0 or 1")


def _check_order(messages: tuple[Message, ...], where: str, weights: bool) -> bool:
    """Whether an assistant message is learned (weight 1 or none), once every weight is checked
    and the messages are in the chat order (an optional system message first, then user and
    assistant alternating); else a LineError at the first out of place."""
    expected, learned = "user", False
    for i, m in enumerate(messages):
        if m.weight is not None:
            _check_weight(f"{where}[{i}]", m.role, m.weight, weights)
        if m.role == "system" and i == 0:
            continue
        if m.role != expected:
            raise LineError(Kind.ROLE_ORDER, f"{where}[{i}] is {m.role}, expected {expected} "
                            "(optional system first, then user and assistant alternating)")
        if expected == "user":
            expected = "assistant"
        else:
            expected, learned = "user", learned or m.weight != 0
    return learned


def _chat(messages: tuple[Message, ...]) -> Chat:
    """The chat example of messages each checked alone, once they are in order and one of them
    is learned."""
    if not _check_order(messages, "messages", True):
        raise LineError(Kind.NO_ASSISTANT, "no assistant message with weight 1: nothing to learn")
    return Chat(messages)


def _check_answer(key: str, content: str) -> str:
    """A side's content, unless it is empty."""
    if not content.strip():
        raise LineError(Kind.MISSING_SIDE, f"{key}[0].content is empty: that side holds no answer")
    return content


def _check_prompt(prompt: tuple[Message, ...]) -> None:
    """A preference prompt (messages each checked alone) takes no weights, is in the chat order
    and ends with the user message the answers answer."""
    _check_order(prompt, "input.messages", False)
    if prompt[-1].role != "user":
        raise LineError(Kind.ROLE_ORDER, f"the last of `input.messages` is {prompt[-1].role}; "
                        "it must be the user message the outputs answer")


def _pair(prompt: tuple[Message, ...], chosen: str, rejected: str) -> Preference:
    """The preference example of a prompt and answers each checked alone, once the prompt passes
    and the answers differ."""
    _check_prompt(prompt)
    if chosen == rejected:
        raise LineError(Kind.IDENTICAL_SIDES, "preferred_output and non_preferred_output hold the "
                        "same content: the pair teaches no preference")
    return Preference(prompt, chosen, rejected)


# ----------------------------------------------------------------- the detailed way


def _message(i: int, m: Any, where: str, weights: bool) -> Message:
    """Message ``i`` of a line's ``where`` list (``weights``: whether it may take one), or a LineError."""
    at = f"{where}[{i}]"
    if not isinstance(m, dict):
        raise LineError(Kind.MESSAGE_NOT_OBJECT, f"{at} is a {type(m).__name__}, not an object")
    unknown = m.keys() - MESSAGE_KEYS
    if unknown:
        allowed = MESSAGE_KEYS if weights else PROMPT_KEYS
        raise LineError(Kind.UNKNOWN_KEY, f"{at} has {len(unknown)} unknown key(s); allowed: {sorted(allowed)}")
    role = m.get("role")
    if role not in ROLES:
        raise LineError(Kind.BAD_ROLE, f"{at}.role is not one of: {', '.join(ROLES)}")
    content = m.get("content")
    if not isinstance(content, str):
        what = "missing" if "content" not in m else f"a {type(content).__name__}"
        raise LineError(Kind.BAD_CONTENT, f"{at}.content is {what}; it must be a string")
    name = m.get("name")
    if "name" in m and not isinstance(name, str):
        raise LineError(Kind.BAD_NAME, f"{at}.name is a {type(name).__name__}; it must be a string")
    if "weight" not in m:
        return Message(role, content, None, name)
    _check_weight(at, role, m["weight"], weights)
    return Message(role, content, int(m["weight"]), name)


def check_example(obj: Any) -> Chat:
    """The chat example of one parsed line.

    Raises:
        LineError: naming the line's first problem.
    """
    if not isinstance(obj, dict):
        raise LineError(Kind.NOT_OBJECT, f"the line is a JSON {type(obj).__name__}, not an object")
    unknown = obj.keys() - TOP_KEYS
    if unknown:
        raise LineError(Kind.UNKNOWN_KEY, f"{len(unknown)} unknown key(s); the only key allowed is 'messages'")
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise LineError(Kind.MISSING_MESSAGES, "`messages` is missing, empty or not a list")
    return _chat(tuple(_message(i, m, "messages", True) for i, m in enumerate(raw)))


def _prompt_of(obj: dict[str, Any]) -> tuple[Message, ...]:
    inp = obj.get("input")
    if inp is None:
        raise LineError(Kind.MISSING_MESSAGES, "`input` is missing; it must hold the prompt's "
                        "`messages`")
    if not isinstance(inp, dict):
        raise LineError(Kind.NOT_OBJECT, f"`input` is a JSON {type(inp).__name__}, not an object")
    unknown = inp.keys() - INPUT_KEYS
    if unknown & TOOL_KEYS:
        raise LineError(Kind.UNKNOWN_KEY, "`input` holds tools or parallel_tool_calls: tools are not "
                        "supported; the only key allowed in `input` is 'messages'")
    if unknown:
        raise LineError(Kind.UNKNOWN_KEY, f"`input` has {len(unknown)} unknown key(s); the only key "
                        "allowed in it is 'messages'")
    raw = inp.get("messages")
    if not isinstance(raw, list) or not raw:
        raise LineError(Kind.MISSING_MESSAGES, "`input.messages` is missing, empty or not a list")
    messages = tuple(_message(i, m, "input.messages", False) for i, m in enumerate(raw))
    _check_prompt(messages)  # before the sides: a broken prompt is the problem named first
    return messages


def _check_side(obj: dict[str, Any], key: str) -> str:
    side = obj.get(key)
    if not isinstance(side, list) or not side:
        raise LineError(Kind.MISSING_SIDE, f"`{key}` is missing, empty or not a list; it must hold "
                        "one assistant message")
    if len(side) > 1:
        raise LineError(Kind.BAD_OUTPUT, f"`{key}` holds {len(side)} messages; it must hold exactly one")
    m = side[0]
    if not isinstance(m, dict):
        raise LineError(Kind.BAD_OUTPUT, f"{key}[0] is a {type(m).__name__}, not an object")
    unknown = m.keys() - OUTPUT_KEYS
    if unknown:
        raise LineError(Kind.BAD_OUTPUT, f"{key}[0] has {len(unknown)} unknown key(s); "
                        f"allowed: {sorted(OUTPUT_KEYS)}")
    if m.get("role") != "assistant":
        raise LineError(Kind.BAD_OUTPUT, f"{key}[0].role is not assistant")
    content = m.get("content")
    if not isinstance(content, str):
        what = "missing" if "content" not in m else f"a {type(content).__name__}"
        raise LineError(Kind.BAD_CONTENT, f"{key}[0].content is {what}; it must be a string")
    return _check_answer(key, content)


def check_pair(obj: Any) -> Preference:
    """The preference example of one parsed line.

    Raises:
        LineError: naming the line's first problem.
    """
    if not isinstance(obj, dict):
        raise LineError(Kind.NOT_OBJECT, f"the line is a JSON {type(obj).__name__}, not an object")
    unknown = obj.keys() - PAIR_KEYS
    if unknown:
        raise LineError(Kind.UNKNOWN_KEY, f"{len(unknown)} unknown key(s); a preference example holds "
                        "only 'input', 'preferred_output' and 'non_preferred_output'")
    prompt = _prompt_of(obj)
    chosen, rejected = (_check_side(obj, key) for key in SIDES)
    return _pair(prompt, chosen, rejected)
