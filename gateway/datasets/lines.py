"""One line of a fine-tuning JSONL file: its error classes and its checks (pure).

Chat lines (``{"messages": [...]}``) and preference lines (OpenAI's DPO format:
``{"input": {"messages": [...]}, "preferred_output": [...], "non_preferred_output": [...]}``)
are decoded by a msgspec fast path when well formed, else checked in detail
(``check_example``, ``check_pair``), which names the first problem as a :class:`LineError`
of a :class:`Kind`. Messages never quote the dataset. The streaming validator
(``gateway.datasets.validation``) calls these per line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

import msgspec


class Kind(StrEnum):
    """Error classes; each makes the file unusable for training."""

    EMPTY_FILE = "empty_file"
    TOO_LARGE = "file_too_large"
    LINE_TOO_LONG = "line_too_long"
    NOT_UTF8 = "not_utf8"
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    MISSING_MESSAGES = "missing_messages"
    MESSAGE_NOT_OBJECT = "message_not_object"
    UNKNOWN_KEY = "unknown_key"
    BAD_ROLE = "bad_role"
    BAD_CONTENT = "bad_content"
    ROLE_ORDER = "role_order"
    NO_ASSISTANT = "no_assistant"
    BAD_WEIGHT = "bad_weight"
    TOO_LONG = "example_too_long"
    TOO_FEW = "too_few_examples"
    MISSING_SIDE = "missing_side"
    IDENTICAL_SIDES = "identical_sides"
    BAD_OUTPUT = "bad_output"
    MIXED_FORMAT = "mixed_format"


class Warn(StrEnum):
    """Warning classes: reported, but the file stays usable."""

    DUPLICATE = "duplicate_example"
    VERY_SHORT = "very_short_example"
    TOKENS_NOT_CHECKED = "tokens_not_checked"


TOP_KEYS = frozenset({"messages"})
MESSAGE_KEYS = frozenset({"role", "content", "weight", "name"})
ROLES = ("system", "user", "assistant")
CHAT, PREFERENCE = "chat", "preference"
PAIR_KEYS = frozenset({"input", "preferred_output", "non_preferred_output"})
INPUT_KEYS = frozenset({"messages"})
TOOL_KEYS = frozenset({"tools", "parallel_tool_calls"})
OUTPUT_KEYS = frozenset({"role", "content"})
SIDES = ("preferred_output", "non_preferred_output")



class FastMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: str
    weight: int | msgspec.UnsetType = msgspec.UNSET
    name: str | msgspec.UnsetType = msgspec.UNSET


class _FastExample(msgspec.Struct, forbid_unknown_fields=True):
    messages: list[FastMessage]


class _FastOutput(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["assistant"]
    content: str


class _FastInput(msgspec.Struct, forbid_unknown_fields=True):
    messages: list[FastMessage]


class _FastPair(msgspec.Struct, forbid_unknown_fields=True):
    input: _FastInput
    preferred_output: list[_FastOutput]
    non_preferred_output: list[_FastOutput]


_FAST = msgspec.json.Decoder(_FastExample)
_FAST_PAIR = msgspec.json.Decoder(_FastPair)


@dataclass(frozen=True, slots=True)
class Pair:
    """One preference example: the prompt's messages and the contents of both answers."""

    prompt: list[dict[str, Any]]
    chosen: str
    rejected: str

    def conversations(self) -> list[list[dict[str, Any]]]:
        """The two sequences a DPO step trains on: prompt + chosen, then prompt + rejected."""
        return [self.prompt + [{"role": "assistant", "content": side}]
                for side in (self.chosen, self.rejected)]


def fast_messages(raw: bytes) -> list[FastMessage] | None:
    """The messages of a well-formed line decoded in C, or None (then the detailed,
    slower path finds and names the problem)."""
    try:
        ex = _FAST.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    msgs = ex.messages
    if not msgs:
        return None
    expected = "user"
    learn = False
    for i, m in enumerate(msgs):
        if m.weight is not msgspec.UNSET and (m.role != "assistant" or m.weight not in (0, 1)):
            return None
        if m.role == "system" and i == 0:
            continue
        if m.role != expected:
            return None
        if expected == "assistant":
            learn = learn or m.weight is msgspec.UNSET or m.weight == 1
            expected = "user"
        else:
            expected = "assistant"
    if not learn:
        return None
    return msgs


def _misordered(roles: Sequence[str]) -> tuple[int, str] | None:
    """(index, expected role) of the first message out of the chat order (optional system
    first, then user and assistant alternating), or None."""
    expected = "user"
    for i, role in enumerate(roles):
        if role == "system" and i == 0:
            continue
        if role != expected:
            return i, expected
        expected = "assistant" if expected == "user" else "user"
    return None


def fast_pair(raw: bytes) -> Pair | None:
    """A well-formed preference line decoded in C, or None (the detailed path then names
    the problem, or finds the line is not a preference example)."""
    try:
        ex = _FAST_PAIR.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    msgs, chosen, rejected = ex.input.messages, ex.preferred_output, ex.non_preferred_output
    if (not msgs or len(chosen) != 1 or len(rejected) != 1 or msgs[-1].role != "user"
            or any(m.weight is not msgspec.UNSET for m in msgs) or _misordered([m.role for m in msgs])):
        return None
    a, b = chosen[0].content, rejected[0].content
    if not a.strip() or not b.strip() or a == b:
        return None
    prompt = [{"role": m.role, "content": m.content} if m.name is msgspec.UNSET
              else {"role": m.role, "content": m.content, "name": m.name} for m in msgs]
    return Pair(prompt, a, b)


def encodable(messages: list[dict[str, Any]]) -> bool:
    """Whether every string of the messages is valid Unicode (no lone surrogates)."""
    try:
        for m in messages:
            for key in ("content", "name"):
                if isinstance(m.get(key), str):
                    m[key].encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class LineError(Exception):
    def __init__(self, kind: Kind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def _check_message(i: int, m: Any, where: str = "messages", weights: bool = True) -> None:
    at = f"{where}[{i}]"
    if not isinstance(m, dict):
        raise LineError(Kind.MESSAGE_NOT_OBJECT, f"{at} is a {type(m).__name__}, not an object")
    unknown = m.keys() - MESSAGE_KEYS
    if unknown:
        raise LineError(Kind.UNKNOWN_KEY, f"{at} has {len(unknown)} unknown key(s); "
                        f"allowed: {sorted(MESSAGE_KEYS if weights else MESSAGE_KEYS - {'weight'})}")
    role = m.get("role")
    if role not in ROLES:
        raise LineError(Kind.BAD_ROLE, f"{at}.role is not one of: {', '.join(ROLES)}")
    if not isinstance(m.get("content"), str):
        what = "missing" if "content" not in m else f"a {type(m['content']).__name__}"
        raise LineError(Kind.BAD_CONTENT, f"{at}.content is {what}; it must be a string")
    if "weight" in m:
        w = m["weight"]
        if not weights:
            raise LineError(Kind.BAD_WEIGHT, f"{at} has a weight; a preference prompt takes no "
                            "weights (the two outputs are what is learned)")
        if role != "assistant":
            raise LineError(Kind.BAD_WEIGHT, f"{at} has a weight but is a {role} "
                            "message; only assistant messages take a weight")
        if isinstance(w, bool) or w not in (0, 1):
            raise LineError(Kind.BAD_WEIGHT, f"{at}.weight must be 0 or 1")


def check_example(obj: Any) -> list[dict[str, Any]]:
    """Return the messages of one parsed line, or raise LineError naming the problem."""
    if not isinstance(obj, dict):
        raise LineError(Kind.NOT_OBJECT, f"the line is a JSON {type(obj).__name__}, not an object")
    unknown = obj.keys() - TOP_KEYS
    if unknown:
        raise LineError(Kind.UNKNOWN_KEY, f"{len(unknown)} unknown key(s); the only key allowed is "
                        "'messages'")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise LineError(Kind.MISSING_MESSAGES, "`messages` is missing, empty or not a list")
    for i, m in enumerate(messages):
        _check_message(i, m)
    _check_order(messages, "messages")
    if not any(m["role"] == "assistant" and m.get("weight", 1) == 1 for m in messages):
        raise LineError(Kind.NO_ASSISTANT, "no assistant message with weight 1: nothing to learn")
    return messages


def _check_order(messages: list[dict[str, Any]], where: str) -> None:
    bad = _misordered([m["role"] for m in messages])
    if bad is not None:
        i, expected = bad
        raise LineError(Kind.ROLE_ORDER, f"{where}[{i}] is {messages[i]['role']}, expected {expected} "
                        "(optional system first, then user and assistant alternating)")


def format_of(obj: Any) -> str | None:
    """The format a parsed line is written in (``"chat"`` or ``"preference"``), or None
    when it is not an object or holds neither format's keys."""
    if not isinstance(obj, dict):
        return None
    if "messages" in obj:
        return CHAT
    return PREFERENCE if obj.keys() & PAIR_KEYS else None


def _check_prompt(obj: dict[str, Any]) -> list[dict[str, Any]]:
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
    messages = inp.get("messages")
    if not isinstance(messages, list) or not messages:
        raise LineError(Kind.MISSING_MESSAGES, "`input.messages` is missing, empty or not a list")
    for i, m in enumerate(messages):
        _check_message(i, m, "input.messages", weights=False)
    _check_order(messages, "input.messages")
    if messages[-1]["role"] != "user":
        raise LineError(Kind.ROLE_ORDER, f"the last of `input.messages` is {messages[-1]['role']}; "
                        "it must be the user message the outputs answer")
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
    if not content.strip():
        raise LineError(Kind.MISSING_SIDE, f"{key}[0].content is empty: that side holds no answer")
    return content


def check_pair(obj: Any) -> Pair:
    """Return the prompt and both answers of one parsed preference line, or raise LineError
    naming the problem."""
    if not isinstance(obj, dict):
        raise LineError(Kind.NOT_OBJECT, f"the line is a JSON {type(obj).__name__}, not an object")
    unknown = obj.keys() - PAIR_KEYS
    if unknown:
        raise LineError(Kind.UNKNOWN_KEY, f"{len(unknown)} unknown key(s); a preference example holds "
                        "only 'input', 'preferred_output' and 'non_preferred_output'")
    prompt = _check_prompt(obj)
    chosen, rejected = (_check_side(obj, key) for key in SIDES)
    if chosen == rejected:
        raise LineError(Kind.IDENTICAL_SIDES, "preferred_output and non_preferred_output hold the "
                        "same content: the pair teaches no preference")
    return Pair(prompt, chosen, rejected)
