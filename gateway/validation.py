"""Dataset validation: a pure, streaming checker of OpenAI-style chat JSONL.

Feed it lines (``Validator.feed``) as they stream in and call ``finish``; it
keeps only counts, the first ``max_errors`` issues, a 16-byte hash per example
(duplicates) and one integer per example (token statistics). Every issue carries
its line number and class; messages never quote the dataset (not even key names
or role values): the report is stored and shown as metadata.
Token checks use a ``TokenCounter`` (the base model's own tokenizer and chat
template); without one they are reported as skipped, not passed.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Protocol


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


class Warn(StrEnum):
    """Warning classes: reported, but the file stays usable."""

    DUPLICATE = "duplicate_example"
    VERY_SHORT = "very_short_example"
    TOKENS_NOT_CHECKED = "tokens_not_checked"


TOP_KEYS = frozenset({"messages"})
MESSAGE_KEYS = frozenset({"role", "content", "weight", "name"})
ROLES = ("system", "user", "assistant")
DEFAULT_EPOCHS = 3
SHORT_CHARS = 8          # an example whose messages hold fewer characters is "very short"
TOKEN_BATCH = 256


@dataclass(frozen=True)
class Issue:
    line: int | None
    kind: str
    message: str


class TokenCounter(Protocol):
    """Counts tokens of whole examples with a model's tokenizer and chat template."""

    name: str

    def count(self, conversations: Sequence[list[dict[str, Any]]]) -> list[tuple[int, int]]:
        """(total tokens, assistant tokens) per conversation."""
        ...


class LineError(Exception):
    def __init__(self, kind: Kind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def _check_message(i: int, m: Any) -> None:
    if not isinstance(m, dict):
        raise LineError(Kind.MESSAGE_NOT_OBJECT,
                        f"messages[{i}] is a {type(m).__name__}, not an object")
    unknown = m.keys() - MESSAGE_KEYS
    if unknown:
        raise LineError(Kind.UNKNOWN_KEY, f"messages[{i}] has {len(unknown)} unknown key(s); "
                        f"allowed: {sorted(MESSAGE_KEYS)}")
    role = m.get("role")
    if role not in ROLES:
        raise LineError(Kind.BAD_ROLE, f"messages[{i}].role is not one of: {', '.join(ROLES)}")
    if not isinstance(m.get("content"), str):
        what = "missing" if "content" not in m else f"a {type(m['content']).__name__}"
        raise LineError(Kind.BAD_CONTENT, f"messages[{i}].content is {what}; it must be a string")
    if "weight" in m:
        w = m["weight"]
        if role != "assistant":
            raise LineError(Kind.BAD_WEIGHT, f"messages[{i}] has a weight but is a {role} "
                            "message; only assistant messages take a weight")
        if isinstance(w, bool) or w not in (0, 1):
            raise LineError(Kind.BAD_WEIGHT, f"messages[{i}].weight must be 0 or 1")


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
    expected = "user"
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system" and i == 0:
            continue
        if role != expected:
            raise LineError(Kind.ROLE_ORDER, f"messages[{i}] is {role}, expected {expected} "
                            "(optional system first, then user and assistant alternating)")
        expected = "assistant" if expected == "user" else "user"
    if not any(m["role"] == "assistant" and m.get("weight", 1) == 1 for m in messages):
        raise LineError(Kind.NO_ASSISTANT, "no assistant message with weight 1: nothing to learn")
    return messages


def _percentile(sorted_values: list[int], q: float) -> int:
    if not sorted_values:
        return 0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


@dataclass
class Validator:
    """Streaming validator; ``feed`` every line (with its newline or not), then ``finish``."""

    max_seq_len: int = 2048
    min_examples: int = 10
    max_errors: int = 100
    max_line_bytes: int = 4 * 1024 * 1024
    counter: TokenCounter | None = None
    errors: list[Issue] = field(default_factory=list)
    warnings: list[Issue] = field(default_factory=list)
    error_counts: Counter[str] = field(default_factory=Counter)
    warning_counts: Counter[str] = field(default_factory=Counter)
    examples: int = 0
    lines: int = 0
    _seen: dict[bytes, int] = field(default_factory=dict)
    _pending: list[tuple[int, list[dict[str, Any]]]] = field(default_factory=list)
    _tokens: list[int] = field(default_factory=list)
    _assistant_tokens: int = 0

    def _error(self, line: int | None, kind: str, message: str) -> None:
        self.error_counts[kind] += 1
        if len(self.errors) < self.max_errors:
            self.errors.append(Issue(line, kind, message))

    def _warn(self, line: int | None, kind: str, message: str) -> None:
        self.warning_counts[kind] += 1
        if len(self.warnings) < self.max_errors:
            self.warnings.append(Issue(line, kind, message))

    def feed(self, lineno: int, raw: bytes, length: int | None = None) -> None:
        """Check one line (1-based ``lineno``); ``length`` is its true size when ``raw``
        was cut short because the line is over ``max_line_bytes``."""
        self.lines = lineno
        size = len(raw) if length is None else length
        if size > self.max_line_bytes:
            self._error(lineno, Kind.LINE_TOO_LONG,
                        f"line is {size} bytes; the limit is {self.max_line_bytes}")
            return
        raw = raw.rstrip(b"\r\n")
        if not raw.strip():
            return  # blank lines are ignored
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self._error(lineno, Kind.NOT_UTF8, f"invalid UTF-8 at byte {e.start + 1} of the line")
            return
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            self._error(lineno, Kind.NOT_JSON, f"not valid JSON: {e.msg} at column {e.colno}")
            return
        except RecursionError:
            self._error(lineno, Kind.NOT_JSON, "not valid JSON: nested too deeply")
            return
        try:
            messages = check_example(obj)
        except LineError as e:
            self._error(lineno, e.kind, e.message)
            return
        self.examples += 1
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        first = self._seen.setdefault(digest, lineno)
        if first != lineno:
            self._warn(lineno, Warn.DUPLICATE, f"exact duplicate of line {first}")
        if sum(len(m["content"]) for m in messages) < SHORT_CHARS:
            self._warn(lineno, Warn.VERY_SHORT,
                       f"very short example (under {SHORT_CHARS} characters of content)")
        if self.counter is not None:
            self._pending.append((lineno, messages))
            if len(self._pending) >= TOKEN_BATCH:
                self._count_tokens()

    def _count_tokens(self) -> None:
        assert self.counter is not None
        counts = self.counter.count([m for _, m in self._pending])
        for (lineno, _), (total, assistant) in zip(self._pending, counts, strict=True):
            self._tokens.append(total)
            self._assistant_tokens += assistant
            if total > self.max_seq_len:
                self._error(lineno, Kind.TOO_LONG, f"example is {total} tokens; the maximum "
                            f"sequence length is {self.max_seq_len}")
        self._pending.clear()

    def finish(self, *, total_bytes: int, over_limit: int | None = None) -> dict[str, Any]:
        """Close the stream; return the report (``over_limit``: the byte limit that was hit)."""
        if self._pending:
            self._count_tokens()
        if over_limit is not None:
            self._error(None, Kind.TOO_LARGE, f"the file exceeds the upload limit of {over_limit} "
                        "bytes; split it or ask your administrator for a higher limit")
        elif total_bytes == 0 or (self.examples == 0 and not self.error_counts):
            self._error(None, Kind.EMPTY_FILE, "the file is empty")
        elif self.examples < self.min_examples:
            self._error(None, Kind.TOO_FEW, f"{self.examples} valid examples; at least "
                        f"{self.min_examples} are needed")
        if self.counter is None:
            self._warn(None, Warn.TOKENS_NOT_CHECKED,
                       "token counts and the maximum sequence length were not checked: "
                       "no base model tokenizer available")
        tokens = sorted(self._tokens)
        total_tokens = sum(tokens)
        stats: dict[str, Any] = {
            "lines": self.lines, "bytes": total_bytes, "examples": self.examples,
            "tokenizer": self.counter.name if self.counter else None,
            "tokens": {"total": total_tokens, "p50": _percentile(tokens, 0.5),
                       "p95": _percentile(tokens, 0.95), "max": tokens[-1] if tokens else 0,
                       "assistant": self._assistant_tokens} if self.counter else None,
            "estimated_training_tokens": (total_tokens * DEFAULT_EPOCHS) if self.counter else None,
            "estimated_epochs": DEFAULT_EPOCHS,
        }
        return {
            "ok": not self.error_counts,
            "errors": [asdict(i) for i in self.errors],
            "error_counts": dict(self.error_counts),
            "warnings": [asdict(i) for i in self.warnings],
            "warning_counts": dict(self.warning_counts),
            "max_seq_len": self.max_seq_len,
            "stats": stats,
        }


class LineSplitter:
    """Turns a stream of byte chunks into lines for a Validator, in bounded memory.

    A line longer than the validator's ``max_line_bytes`` is not kept whole: only
    its length is, and it is reported as too long.
    """

    def __init__(self, validator: Validator):
        self.v = validator
        self.buf = bytearray()
        self.buf_len = 0          # true length of the current line (may exceed buf)
        self.lineno = 0
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        limit = self.v.max_line_bytes
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            piece = chunk[start:] if nl < 0 else chunk[start:nl + 1]
            room = limit + 1 - len(self.buf)
            if room > 0:
                self.buf += piece[:room]
            self.buf_len += len(piece)
            if nl < 0:
                return
            self._emit()
            start = nl + 1

    def _emit(self) -> None:
        self.lineno += 1
        self.v.feed(self.lineno, bytes(self.buf), self.buf_len)
        self.buf.clear()
        self.buf_len = 0

    def finish(self, over_limit: int | None = None) -> dict[str, Any]:
        if self.buf_len and over_limit is None:
            self._emit()
        return self.v.finish(total_bytes=self.total, over_limit=over_limit)


def validate_stream(chunks: Iterable[bytes], **kwargs: Any) -> dict[str, Any]:
    """Validate a stream of byte chunks (e.g. a file read in blocks) in one go."""
    splitter = LineSplitter(Validator(**kwargs))
    for chunk in chunks:
        splitter.feed(chunk)
    return splitter.finish()


def validate_lines(lines: Iterable[bytes], **kwargs: Any) -> dict[str, Any]:
    """Validate an iterable of raw lines (tests; small inputs)."""
    v = Validator(**kwargs)
    total = 0
    for lineno, raw in enumerate(lines, 1):
        total += len(raw)
        v.feed(lineno, raw)
    return v.finish(total_bytes=total)
