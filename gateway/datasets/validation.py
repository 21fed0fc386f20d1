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
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol

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
# Token statistics: every example up to EXACT_FIRST, then one in SAMPLE_EVERY (weighted).
# The maximum-length rule is enforced on every example regardless (see Validator._tokens_for).
EXACT_FIRST = 1000
SAMPLE_EVERY = 32


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

    def bound(self, messages: list[dict[str, Any]]) -> int | None:
        """A cheap proven upper bound on the example's tokens, or None if there is none."""
        ...


class _FastMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: str
    weight: int | msgspec.UnsetType = msgspec.UNSET
    name: str | msgspec.UnsetType = msgspec.UNSET


class _FastExample(msgspec.Struct, forbid_unknown_fields=True):
    messages: list[_FastMessage]


_FAST = msgspec.json.Decoder(_FastExample)


def _fast_messages(raw: bytes) -> list[_FastMessage] | None:
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


def _encodable(messages: list[dict[str, Any]]) -> bool:
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


def _weighted_percentile(pairs: list[tuple[int, int]], q: float) -> int:
    """Percentile of (value, weight) pairs sorted by value."""
    if not pairs:
        return 0
    target = q * sum(w for _, w in pairs)
    acc = 0
    for value, w in pairs:
        acc += w
        if acc >= target:
            return value
    return pairs[-1][0]


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
    exact_checks: int = 0
    _seen: dict[bytes, int] = field(default_factory=dict)
    _pending: list[tuple[int, list[dict[str, Any]], int, bool]] = field(default_factory=list)
    _sample: list[tuple[int, int]] = field(default_factory=list)   # (tokens, weight)
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
        if not raw or raw.isspace():
            return  # blank lines are ignored
        fast = _fast_messages(raw)
        messages: list[dict[str, Any]] | None
        if fast is not None:
            messages = None   # built only if a token count needs them
            chars = sum(len(m.content) for m in fast)
        else:
            messages = self._detailed(lineno, raw)
            if messages is None:
                return
            chars = sum(len(m["content"]) for m in messages)
        if (b"\\ud" in raw or b"\\uD" in raw) and not _encodable(
                messages or [{"role": m.role, "content": m.content} for m in fast or ()]):
            # JSON may escape a lone UTF-16 surrogate (\ud800); no tokenizer can encode it
            self._error(lineno, Kind.NOT_UTF8, "a string holds a lone surrogate escape (\\ud800-\\udfff): "
                        "not valid Unicode")
            return
        self._accept(lineno, raw, chars, messages, fast)

    def _detailed(self, lineno: int, raw: bytes) -> list[dict[str, Any]] | None:
        """The slow path: find and record the line's first problem (None), or its messages."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self._error(lineno, Kind.NOT_UTF8, f"invalid UTF-8 at byte {e.start + 1} of the line")
            return None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            self._error(lineno, Kind.NOT_JSON, f"not valid JSON: {e.msg} at column {e.colno}")
            return None
        except RecursionError:
            self._error(lineno, Kind.NOT_JSON, "not valid JSON: nested too deeply")
            return None
        try:
            return check_example(obj)
        except LineError as e:
            self._error(lineno, e.kind, e.message)
            return None

    def _accept(self, lineno: int, raw: bytes, chars: int, messages: list[dict[str, Any]] | None,
                fast: list[_FastMessage] | None) -> None:
        index = self.examples
        self.examples += 1
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        first = self._seen.setdefault(digest, lineno)
        if first != lineno:
            self._warn(lineno, Warn.DUPLICATE, f"exact duplicate of line {first}")
        if chars < SHORT_CHARS:
            self._warn(lineno, Warn.VERY_SHORT,
                       f"very short example (under {SHORT_CHARS} characters of content)")
        if self.counter is None:
            return
        if messages is None:
            messages = [{"role": m.role, "content": m.content} for m in fast or ()]
        weight = 1 if index < EXACT_FIRST else (SAMPLE_EVERY if index % SAMPLE_EVERY == 0 else 0)
        bound = self.counter.bound(messages) if weight == 0 else None
        if weight or bound is None or bound > self.max_seq_len:
            # counted exactly: sampled for statistics, or possibly over the length limit
            self._pending.append((lineno, messages, weight, True))
            if len(self._pending) >= TOKEN_BATCH:
                self._count_tokens()

    def _count_tokens(self) -> None:
        assert self.counter is not None
        counts = self.counter.count([m for _, m, _, _ in self._pending])
        self.exact_checks += len(counts)
        for (lineno, _, weight, _), (total, assistant) in zip(self._pending, counts, strict=True):
            if weight:
                self._sample.append((total, weight))
                self._assistant_tokens += assistant * weight
            if total > self.max_seq_len:
                self._error(lineno, Kind.TOO_LONG, f"example is {total} tokens; the maximum "
                            f"sequence length is {self.max_seq_len}")
        self._pending.clear()

    def _token_stats(self) -> dict[str, Any] | None:
        if self.counter is None:
            return None
        pairs = sorted(self._sample)
        exact = self.examples <= EXACT_FIRST
        return {"total": sum(t * w for t, w in pairs), "p50": _weighted_percentile(pairs, 0.5),
                "p95": _weighted_percentile(pairs, 0.95), "max": pairs[-1][0] if pairs else 0,
                "assistant": self._assistant_tokens, "exact": exact,
                "sampled_examples": len(pairs)}

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
        tokens = self._token_stats()
        stats: dict[str, Any] = {
            "lines": self.lines, "bytes": total_bytes, "examples": self.examples,
            "tokenizer": self.counter.name if self.counter else None,
            "tokens": tokens,
            "estimated_training_tokens": tokens["total"] * DEFAULT_EPOCHS if tokens else None,
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
        self.rest = b""           # the start of the current, unfinished line (capped)
        self.rest_len = 0         # its true length
        self.lineno = 0
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        """Pass on every line ``chunk`` completes to the validator; keep the unfinished rest (capped)."""
        self.total += len(chunk)
        parts = chunk.split(b"\n")
        if len(parts) == 1:
            self._extend(chunk)
            return
        self._extend(parts[0])
        self._emit(self.rest, self.rest_len)
        feed, limit = self.v.feed, self.v.max_line_bytes
        for line in parts[1:-1]:
            self.lineno += 1
            feed(self.lineno, line[:limit + 1], len(line))
        self.rest, self.rest_len = b"", 0
        self._extend(parts[-1])

    def _extend(self, piece: bytes) -> None:
        room = self.v.max_line_bytes + 1 - len(self.rest)
        if room > 0:
            self.rest += piece[:room]
        self.rest_len += len(piece)

    def _emit(self, raw: bytes, length: int) -> None:
        self.lineno += 1
        self.v.feed(self.lineno, raw, length)

    def finish(self, over_limit: int | None = None) -> dict[str, Any]:
        """Emit the last line (unless the upload hit ``over_limit``) and return the validator's report."""
        if self.rest_len and over_limit is None:
            self._emit(self.rest, self.rest_len)
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
