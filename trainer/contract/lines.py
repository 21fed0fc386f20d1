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

Tool calling (OpenAI's chat format for function calling): a chat line may hold ``tools`` (the
function schemas: ``{"type": "function", "function": {"name", "description"?, "parameters"?,
"strict"?}}``, names unique) and ``parallel_tool_calls`` (a bool); an assistant message may hold
``tool_calls`` (each ``{"id", "type": "function", "function": {"name", "arguments"}}``: a unique
id, a function ``tools`` declares, arguments a JSON object text holding the schema's required
keys; ``content`` may then be null or left out); the calls are answered by ``tool`` messages
(``tool_call_id`` naming a waiting call, one answer each) that come right after it, and the
assistant speaks next. A conversation may end with an unanswered call (that call is what it
teaches). Tool results are never trained on (they are not the assistant's); the assistant's
calls are, under its ``weight``. Preference lines take no tools (refused by name).

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
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BeforeValidator, ConfigDict, TypeAdapter, ValidationError

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
_GIVEN_LIST = AfterValidator(_not_null)  # the same for a list (before, JSON arrays would reach a strict tuple as lists)


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
    BAD_TOOLS = "bad_tools"
    BAD_TOOL_CALL = "bad_tool_call"
    UNDECLARED_FUNCTION = "undeclared_function"
    BAD_ARGUMENTS = "bad_arguments"
    BAD_TOOL_MESSAGE = "bad_tool_message"
    UNKNOWN_TOOL_CALL_ID = "unknown_tool_call_id"
    UNANSWERED_TOOL_CALL = "unanswered_tool_call"


CHAT, PREFERENCE = "chat", "preference"
Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)
TOP_KEYS = frozenset({"messages", "tools", "parallel_tool_calls"})
MESSAGE_KEYS = frozenset({"role", "content", "weight", "name", "tool_calls", "tool_call_id"})
PROMPT_KEYS = frozenset({"role", "content", "name"})
LEGACY_FUNCTION_KEYS = frozenset({"functions", "function_call"})
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a function's name."""
PAIR_KEYS = frozenset({"input", "preferred_output", "non_preferred_output"})
INPUT_KEYS = frozenset({"messages"})
TOOL_KEYS = frozenset({"tools", "parallel_tool_calls"})
OUTPUT_KEYS = frozenset({"role", "content"})
SIDES = ("preferred_output", "non_preferred_output")
_HOLDS = {CHAT: "'messages'", PREFERENCE: "'input', 'preferred_output' and 'non_preferred_output'"}


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """A call's function: its name and its arguments (JSON text, as OpenAI writes them)."""

    name: str
    arguments: str
    __pydantic_config__ = _STRICT


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One entry of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"]
    function: FunctionCall
    __pydantic_config__ = _STRICT


@dataclass(frozen=True, slots=True)
class Function:
    """A declared function: name, description and JSON-schema ``parameters`` as the line gives them."""

    name: str
    description: Annotated[str | None, _GIVEN] = None
    parameters: Annotated[dict[str, Any] | None, _GIVEN_LIST] = None
    strict: Annotated[bool | None, _GIVEN] = None
    __pydantic_config__ = _STRICT


@dataclass(frozen=True, slots=True)
class Tool:
    """One entry of a line's ``tools``."""

    type: Literal["function"]
    function: Function
    __pydantic_config__ = _STRICT

    def schema(self) -> dict[str, Any]:
        """The tool as a chat template takes it (``tools=``): OpenAI's JSON shape."""
        f = self.function
        function: dict[str, Any] = {"name": f.name}
        if f.description is not None:
            function["description"] = f.description
        if f.parameters is not None:
            function["parameters"] = f.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a valid line. ``weight`` is None when the line gives none (an assistant
    message is then trained on); ``name`` is kept but never rendered (see the module's docstring);
    ``content`` is None only on an assistant message with ``tool_calls``."""

    role: Role
    content: str | None = None
    weight: Annotated[int | None, _GIVEN] = None
    name: Annotated[str | None, _GIVEN] = None
    tool_calls: Annotated[tuple[ToolCall, ...] | None, _GIVEN_LIST] = None
    tool_call_id: Annotated[str | None, _GIVEN] = None
    __pydantic_config__ = _STRICT

    def turn(self, answers: str | None = None) -> dict[str, Any]:
        """The message as a chat template renders it: role and content, an assistant's calls as
        Hugging Face templates take them (arguments decoded to an object), a tool answer with its
        call's id and the function name it answers (``answers``; some templates print it)."""
        turn: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name,
                                                "arguments": json.loads(c.function.arguments)}}
                                  for c in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
            if answers is not None:
                turn["name"] = answers
        return turn


def _turns(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """The messages as a chat template renders them (a tool answer knows its function's name)."""
    called = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    return [m.turn(called.get(m.tool_call_id) if m.tool_call_id is not None else None) for m in messages]


@dataclass(frozen=True, slots=True)
class Chat:
    """A valid chat line."""

    messages: tuple[Message, ...]
    tools: Annotated[tuple[Tool, ...] | None, _GIVEN_LIST] = None
    parallel_tool_calls: Annotated[bool | None, _GIVEN] = None
    __pydantic_config__ = _STRICT

    @property
    def weights(self) -> list[int]:
        """One weight per assistant message, in order (1 where the line gives none)."""
        return [1 if m.weight is None else m.weight for m in self.messages if m.role == "assistant"]

    @property
    def chars(self) -> int:
        """Characters of content (a call's name and arguments count as the assistant's)."""
        return sum(len(m.content or "") + sum(len(c.function.name) + len(c.function.arguments)
                                              for c in m.tool_calls or ()) for m in self.messages)

    @property
    def calls(self) -> int:
        """The number of tool calls the line's assistant makes."""
        return sum(len(m.tool_calls or ()) for m in self.messages)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The line's tools as a chat template takes them (``tools=``), None when it declares none."""
        return [t.schema() for t in self.tools] if self.tools else None

    def conversations(self) -> list[list[dict[str, Any]]]:
        """The one sequence a step trains on, as the chat template renders it."""
        return [_turns(self.messages)]


@dataclass(frozen=True, slots=True)
class Preference:
    """A valid preference line: the prompt's messages and the contents of both answers."""

    prompt: tuple[Message, ...]
    chosen: str
    rejected: str

    @property
    def chars(self) -> int:
        """Characters of content: the prompt's and its shorter side's."""
        return sum(len(m.content or "") for m in self.prompt) + min(len(self.chosen), len(self.rejected))

    def tool_schemas(self) -> None:
        """A preference line declares no tools."""
        return None

    def conversations(self) -> list[list[dict[str, Any]]]:
        """The two sequences a DPO step trains on: prompt + chosen, then prompt + rejected."""
        turns = _turns(self.prompt)
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
            return _chat(chat.messages, chat.tools, chat.parallel_tool_calls) if chat.messages else None
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
    try:
        if isinstance(example, Chat):
            json.dumps([example.conversations(), example.tool_schemas()], ensure_ascii=False).encode("utf-8")
            for m in example.messages:
                if m.name is not None:
                    m.name.encode("utf-8")
            return True
        strings = [s for m in example.prompt for s in (m.content, m.name) if s is not None]
        for s in [*strings, example.chosen, example.rejected]:
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


def _check_tools(tools: tuple[Tool, ...] | None) -> dict[str, Function]:
    """The functions a line declares, by name: names that follow OpenAI's rule, each once, with
    an object schema for parameters (when given)."""
    if tools is None:
        return {}
    if not tools:
        raise LineError(Kind.BAD_TOOLS, "`tools` is empty; leave it out, or declare a function")
    declared: dict[str, Function] = {}
    for i, tool in enumerate(tools):
        f = tool.function
        if not FUNCTION_NAME.fullmatch(f.name):
            raise LineError(Kind.BAD_TOOLS, f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                            "underscores or dashes")
        if f.name in declared:
            raise LineError(Kind.BAD_TOOLS, f"tools[{i}] declares a function name an earlier tool "
                            "declares; each function is declared once")
        params = f.parameters
        if params is not None and params.get("type", "object") != "object":
            raise LineError(Kind.BAD_TOOLS, f"tools[{i}].function.parameters must be a JSON schema of "
                            "type object (the arguments are an object)")
        if params is not None and not isinstance(params.get("required", []), list):
            raise LineError(Kind.BAD_TOOLS, f"tools[{i}].function.parameters.required must be a list")
        declared[f.name] = f
    return declared


def _check_calls(at: str, calls: tuple[ToolCall, ...], declared: dict[str, Function],
                 parallel: bool | None, seen: set[str]) -> dict[str, str]:
    """An assistant message's calls: each with a new id, a declared function and arguments that are
    a JSON object holding the schema's required keys; one call only when parallel calls are off.
    Returns the calls' function names by id (the answers now awaited)."""
    if not calls:
        raise LineError(Kind.BAD_TOOL_CALL, f"{at}.tool_calls is empty; leave it out, or make a call")
    if parallel is False and len(calls) > 1:
        raise LineError(Kind.BAD_TOOL_CALL, f"{at} makes {len(calls)} calls but parallel_tool_calls "
                        "is false: one call per message")
    waiting: dict[str, str] = {}
    for j, call in enumerate(calls):
        where = f"{at}.tool_calls[{j}]"
        if not call.id.strip():
            raise LineError(Kind.BAD_TOOL_CALL, f"{where}.id is empty; each call needs an id its "
                            "tool message answers")
        if call.id in seen or call.id in waiting:
            raise LineError(Kind.BAD_TOOL_CALL, f"{where}.id is the id of an earlier call; each call's "
                            "id is unique in the line")
        function = declared.get(call.function.name)
        if function is None:
            why = "but the line declares no tools" if not declared else "that no entry of `tools` declares"
            raise LineError(Kind.UNDECLARED_FUNCTION, f"{where} calls a function {why}")
        try:
            args = json.loads(call.function.arguments)
        except (ValueError, RecursionError) as e:
            raise LineError(Kind.BAD_ARGUMENTS, f"{where}.function.arguments is not valid JSON text "
                            "(it must be a string holding a JSON object)") from e
        if not isinstance(args, dict):
            raise LineError(Kind.BAD_ARGUMENTS, f"{where}.function.arguments holds a JSON "
                            f"{type(args).__name__}, not an object")
        required = (function.parameters or {}).get("required", [])
        missing = [k for k in required if k not in args]
        if missing:
            raise LineError(Kind.BAD_ARGUMENTS, f"{where}.function.arguments lacks {len(missing)} "
                            "parameter(s) the function's schema requires")
        waiting[call.id] = call.function.name
    return waiting


def _check_roles(i: int, m: Message, where: str, tools: bool) -> None:
    """What one message may hold for its role: null content only with calls, calls only from the
    assistant, a ``tool_call_id`` on (and only on) a tool message; none of them without tools."""
    at = f"{where}[{i}]"
    if not tools and (m.tool_calls is not None or m.tool_call_id is not None or m.role == "tool"):
        raise LineError(Kind.UNKNOWN_KEY, f"{at} is a tool call or answer; a preference prompt takes no "
                        "tools (tool calling is trained by supervised jobs on chat lines)")
    if m.tool_calls is not None and m.role != "assistant":
        raise LineError(Kind.BAD_TOOL_CALL, f"{at} is a {m.role} message with tool_calls; only the "
                        "assistant calls tools")
    if m.role == "tool" and m.tool_call_id is None:
        raise LineError(Kind.BAD_TOOL_MESSAGE, f"{at} is a tool message without tool_call_id; it must "
                        "name the call it answers")
    if m.tool_call_id is not None and m.role != "tool":
        raise LineError(Kind.BAD_TOOL_MESSAGE, f"{at} is a {m.role} message with tool_call_id; only a "
                        "tool message answers a call")
    if m.content is None and not m.tool_calls:
        raise LineError(Kind.BAD_CONTENT, f"{at}.content is null; only an assistant message with "
                        "tool_calls may leave it out")


def _check_order(messages: tuple[Message, ...], where: str, weights: bool,
                 declared: dict[str, Function] | None = None, parallel: bool | None = None) -> bool:
    """Whether an assistant message is learned (weight 1 or none), once every weight and tool call
    is checked and the messages are in the chat order: an optional system message first, then
    user and assistant alternating, where an assistant's calls are answered by tool messages (one
    each, right after it) before the assistant speaks again; else a LineError at the first out of
    place. ``declared``: the line's functions (None: a preference prompt, which takes no tools)."""
    expected, learned = "user", False
    waiting: dict[str, str] = {}      # the calls not answered yet, by id
    seen: set[str] = set()            # every call id so far
    caller = -1                       # the assistant message whose calls are awaited
    for i, m in enumerate(messages):
        if m.weight is not None:
            _check_weight(f"{where}[{i}]", m.role, m.weight, weights)
        _check_roles(i, m, where, declared is not None)
        if m.role == "system" and i == 0:
            continue
        if m.role == "tool":
            assert m.tool_call_id is not None
            if m.tool_call_id not in waiting:
                why = "an answered call" if m.tool_call_id in seen else "no call of the line"
                raise LineError(Kind.UNKNOWN_TOOL_CALL_ID, f"{where}[{i}].tool_call_id names {why}; a tool "
                                "message answers a waiting call of the assistant message before it")
            del waiting[m.tool_call_id]
            expected = "assistant" if not waiting else "tool"
            continue
        if waiting:
            raise LineError(Kind.UNANSWERED_TOOL_CALL, f"{where}[{caller}] makes {len(waiting)} call(s) "
                            f"that no tool message answers before {where}[{i}]")
        if m.role != expected:
            raise LineError(Kind.ROLE_ORDER, f"{where}[{i}] is {m.role}, expected {expected} "
                            "(optional system first, then user and assistant alternating; tool "
                            "messages answer the assistant's calls)")
        if expected == "user":
            expected = "assistant"
            continue
        learned = learned or m.weight != 0
        if m.tool_calls:
            assert declared is not None      # _check_roles refused calls in a prompt
            waiting = _check_calls(f"{where}[{i}]", m.tool_calls, declared, parallel, seen)
            seen.update(waiting)
            caller, expected = i, "tool"
        else:
            expected = "user"
    if waiting and caller != len(messages) - 1:
        raise LineError(Kind.UNANSWERED_TOOL_CALL, f"{where}[{caller}] makes {len(waiting)} call(s) that "
                        "no tool message answers (only the last message may end on a call)")
    return learned


def _chat(messages: tuple[Message, ...], tools: tuple[Tool, ...] | None = None,
          parallel: bool | None = None) -> Chat:
    """The chat example of messages each checked alone, once the tools are sound, the messages
    and calls are in order and one assistant message is learned."""
    declared = _check_tools(tools)
    if not _check_order(messages, "messages", True, declared, parallel):
        raise LineError(Kind.NO_ASSISTANT, "no assistant message with weight 1: nothing to learn")
    return Chat(messages, tools, parallel)


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


def _object(value: Any, at: str, kind: Kind) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise LineError(kind, f"{at} is a {_json_type(value)}, not an object")
    return value


def _json_type(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(value), type(value).__name__)


def _keys(obj: dict[str, Any], allowed: frozenset[str], at: str, kind: Kind) -> None:
    unknown = obj.keys() - allowed
    if unknown:
        raise LineError(kind, f"{at} has {len(unknown)} unknown key(s); allowed: {sorted(allowed)}")


def _tools(raw: Any) -> tuple[Tool, ...]:
    """A line's ``tools`` (present), each entry's shape checked; the rules check the rest."""
    if not isinstance(raw, list):
        raise LineError(Kind.BAD_TOOLS, f"`tools` is a {_json_type(raw)}; it must be a list of "
                        "{\"type\": \"function\", \"function\": {...}} entries")
    tools = []
    for i, entry in enumerate(raw):
        at = f"tools[{i}]"
        _keys(_object(entry, at, Kind.BAD_TOOLS), frozenset({"type", "function"}), at, Kind.BAD_TOOLS)
        if entry.get("type") != "function":
            raise LineError(Kind.BAD_TOOLS, f"{at}.type must be \"function\"")
        f = _object(entry.get("function"), f"{at}.function", Kind.BAD_TOOLS)
        _keys(f, frozenset({"name", "description", "parameters", "strict"}), f"{at}.function", Kind.BAD_TOOLS)
        if not isinstance(f.get("name"), str):
            raise LineError(Kind.BAD_TOOLS, f"{at}.function.name is missing or not a string")
        for key, types_, what in (("description", str, "a string"), ("parameters", dict, "an object"),
                                  ("strict", bool, "true or false")):
            if key in f and not isinstance(f[key], types_):
                raise LineError(Kind.BAD_TOOLS, f"{at}.function.{key} must be {what}")
        tools.append(Tool("function", Function(f["name"], f.get("description"), f.get("parameters"),
                                               f.get("strict"))))
    return tuple(tools)


def _calls(raw: Any, at: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (present), each entry's shape checked."""
    if not isinstance(raw, list):
        raise LineError(Kind.BAD_TOOL_CALL, f"{at}.tool_calls is a {_json_type(raw)}; it must be a list")
    calls = []
    for j, entry in enumerate(raw):
        where = f"{at}.tool_calls[{j}]"
        _keys(_object(entry, where, Kind.BAD_TOOL_CALL), frozenset({"id", "type", "function"}), where,
              Kind.BAD_TOOL_CALL)
        if not isinstance(entry.get("id"), str):
            raise LineError(Kind.BAD_TOOL_CALL, f"{where}.id is missing or not a string; each call needs "
                            "an id its tool message answers")
        if entry.get("type") != "function":
            raise LineError(Kind.BAD_TOOL_CALL, f"{where}.type must be \"function\"")
        f = _object(entry.get("function"), f"{where}.function", Kind.BAD_TOOL_CALL)
        _keys(f, frozenset({"name", "arguments"}), f"{where}.function", Kind.BAD_TOOL_CALL)
        if not isinstance(f.get("name"), str):
            raise LineError(Kind.BAD_TOOL_CALL, f"{where}.function.name is missing or not a string")
        if not isinstance(f.get("arguments"), str):
            raise LineError(Kind.BAD_ARGUMENTS, f"{where}.function.arguments is missing or not a string "
                            "(OpenAI's format holds the arguments as JSON text)")
        calls.append(ToolCall(entry["id"], "function", FunctionCall(f["name"], f["arguments"])))
    return tuple(calls)


def _message(i: int, m: Any, where: str, weights: bool) -> Message:
    """Message ``i`` of a line's ``where`` list (``weights``: whether it may take one), or a LineError."""
    at = f"{where}[{i}]"
    if not isinstance(m, dict):
        raise LineError(Kind.MESSAGE_NOT_OBJECT, f"{at} is a {type(m).__name__}, not an object")
    unknown = m.keys() - MESSAGE_KEYS
    if unknown & LEGACY_FUNCTION_KEYS:
        raise LineError(Kind.UNKNOWN_KEY, f"{at} uses the legacy function_call format; write "
                        "tool_calls (and the line's tools) instead")
    if unknown:   # (a prompt message's tool keys are known keys: the rules refuse them by name)
        allowed = MESSAGE_KEYS if weights else PROMPT_KEYS
        raise LineError(Kind.UNKNOWN_KEY, f"{at} has {len(unknown)} unknown key(s); allowed: {sorted(allowed)}")
    role = m.get("role")
    if role not in ROLES:
        raise LineError(Kind.BAD_ROLE, f"{at}.role is not one of: {', '.join(ROLES)}")
    content = m.get("content")
    if (content is not None and not isinstance(content, str)) or ("content" not in m and "tool_calls" not in m):
        what = "missing" if "content" not in m else f"a {_json_type(content)}"
        raise LineError(Kind.BAD_CONTENT, f"{at}.content is {what}; it must be a string")
    name = m.get("name")
    if "name" in m and not isinstance(name, str):
        raise LineError(Kind.BAD_NAME, f"{at}.name is a {type(name).__name__}; it must be a string")
    calls = _calls(m["tool_calls"], at) if "tool_calls" in m else None
    call_id = m.get("tool_call_id")
    if "tool_call_id" in m and not isinstance(call_id, str):
        raise LineError(Kind.BAD_TOOL_MESSAGE, f"{at}.tool_call_id is a {_json_type(call_id)}; it must be "
                        "the id (a string) of the call it answers")
    weight = None
    if "weight" in m:
        _check_weight(at, role, m["weight"], weights)
        weight = int(m["weight"])
    return Message(role, content, weight, name, calls, call_id)


def check_example(obj: Any) -> Chat:
    """The chat example of one parsed line.

    Raises:
        LineError: naming the line's first problem.
    """
    if not isinstance(obj, dict):
        raise LineError(Kind.NOT_OBJECT, f"the line is a JSON {type(obj).__name__}, not an object")
    unknown = obj.keys() - TOP_KEYS
    if unknown & LEGACY_FUNCTION_KEYS:
        raise LineError(Kind.UNKNOWN_KEY, "the line uses the legacy `functions` format; declare the "
                        "functions in `tools` and write the calls as tool_calls")
    if unknown:
        raise LineError(Kind.UNKNOWN_KEY, f"{len(unknown)} unknown key(s); allowed: {sorted(TOP_KEYS)}")
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise LineError(Kind.MISSING_MESSAGES, "`messages` is missing, empty or not a list")
    tools = _tools(obj["tools"]) if "tools" in obj else None
    parallel = obj.get("parallel_tool_calls")
    if "parallel_tool_calls" in obj and not isinstance(parallel, bool):
        raise LineError(Kind.BAD_TOOLS, "`parallel_tool_calls` must be true or false")
    return _chat(tuple(_message(i, m, "messages", True) for i, m in enumerate(raw)), tools, parallel)


def _prompt_of(obj: dict[str, Any]) -> tuple[Message, ...]:
    inp = obj.get("input")
    if inp is None:
        raise LineError(Kind.MISSING_MESSAGES, "`input` is missing; it must hold the prompt's "
                        "`messages`")
    if not isinstance(inp, dict):
        raise LineError(Kind.NOT_OBJECT, f"`input` is a JSON {type(inp).__name__}, not an object")
    unknown = inp.keys() - INPUT_KEYS
    if unknown & TOOL_KEYS:
        raise LineError(Kind.UNKNOWN_KEY, "`input` holds tools or parallel_tool_calls: a preference pair "
                        "takes no tools (tool calling is trained by supervised jobs on chat lines); the "
                        "only key allowed in `input` is 'messages'")
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
