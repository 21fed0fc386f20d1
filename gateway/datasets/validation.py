"""Dataset validation: a pure, streaming checker of OpenAI-style fine-tuning JSONL.

A file holds one of two formats, set by its first line that is a JSON object with
either format's keys: chat (``{"messages": [...]}``) or preference, OpenAI's DPO
format (``{"input": {"messages": [...]}, "preferred_output": [assistant message],
"non_preferred_output": [assistant message]}``); a line of the other format is a
``mixed_format`` error.
For a preference file ``stats["tokens"]`` counts a pair as both its sequences
(prompt + chosen and prompt + rejected: a DPO step trains on both) and
``stats["preference"]`` gives each side's statistics.

Feed it lines (``Validator.feed``) as they stream in and call ``finish``; it
keeps only counts, the first ``max_errors`` issues, a 16-byte hash per example
(duplicates) and a few integers per sampled example (token and per-side
statistics). Every issue carries its line number and class; messages never quote
the dataset (not even key names or role values): the report is stored and shown
as metadata.
Token checks use a ``TokenCounter`` (the base model's own tokenizer and chat
template); without one they are reported as skipped, not passed. One line's grammar (its
error classes and checks) is the contract's, ``trainer.contract.lines``: the trainer reads every
line with the same ``LineReader``, so a file this accepts is one the trainer reads.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from trainer.contract.lines import CHAT, PREFERENCE, Chat, Example, Kind, LineError, LineReader, Preference
from trainer.contract.spec import HYPERPARAMETER_DEFAULTS

DEFAULT_EPOCHS = HYPERPARAMETER_DEFAULTS["epochs"]   # the estimate's: the trainer's default
SHORT_CHARS = 8          # an example whose messages hold fewer characters is "very short"
TOKEN_BATCH = 256
# Token statistics: every example up to EXACT_FIRST, then one in SAMPLE_EVERY (weighted).
# The maximum-length rule is enforced on every example regardless (see Validator._tokens_for).
EXACT_FIRST = 1000
SAMPLE_EVERY = 32


class Warn(StrEnum):
    """Warning classes: reported, but the file stays usable."""

    DUPLICATE = "duplicate_example"
    VERY_SHORT = "very_short_example"
    TOKENS_NOT_CHECKED = "tokens_not_checked"


@dataclass(frozen=True)
class Issue:
    line: int | None
    kind: str
    message: str


class TokenCounter(Protocol):
    """Counts tokens of whole examples with a model's tokenizer and chat template."""

    name: str

    def count(self, conversations: Sequence[list[dict[str, Any]]],
              tools: Sequence[list[dict[str, Any]] | None] | None = None) -> list[tuple[int, int]]:
        """(total tokens, assistant tokens) per conversation (``tools``: each one's function schemas
        or None; given only when a batch holds a tool-calling line)."""
        ...

    def bound(self, messages: list[dict[str, Any]]) -> int | None:
        """A cheap proven upper bound on the example's tokens, or None if there is none."""
        ...

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


def _distribution(pairs: list[tuple[int, int]]) -> dict[str, int]:
    """p50, p95 and max of (value, weight) pairs sorted by value."""
    return {"p50": _weighted_percentile(pairs, 0.5), "p95": _weighted_percentile(pairs, 0.95),
            "max": pairs[-1][0] if pairs else 0}


def _sample_weight(index: int) -> int:
    """The weight of the ``index``-th example in the statistics sample (0: not sampled)."""
    return 1 if index < EXACT_FIRST else (SAMPLE_EVERY if index % SAMPLE_EVERY == 0 else 0)


@dataclass
class _Sides:
    """Per-side statistics of preference pairs: sampled (value, weight) lists like the token
    sample, one entry per side, and each side's exact longest content."""

    tokens: tuple[list[tuple[int, int]], list[tuple[int, int]]] = field(default_factory=lambda: ([], []))
    chars: tuple[list[tuple[int, int]], list[tuple[int, int]]] = field(default_factory=lambda: ([], []))
    max_chars: list[int] = field(default_factory=lambda: [0, 0])

    def add_chars(self, pair: Preference, weight: int) -> None:
        """Record both sides' content lengths (sampled with ``weight``; the maxima always)."""
        for i, text in enumerate((pair.chosen, pair.rejected)):
            self.max_chars[i] = max(self.max_chars[i], len(text))
            if weight:
                self.chars[i].append((len(text), weight))

    def report(self, pairs: int, counted: bool) -> dict[str, Any]:
        """``{"pairs", "chosen", "rejected"}``; token figures are None when not ``counted``."""
        out: dict[str, Any] = {"pairs": pairs}
        for i, name in enumerate(("chosen", "rejected")):
            toks = sorted(self.tokens[i])
            side: dict[str, Any] = ({"total": sum(t * w for t, w in toks), **_distribution(toks)} if counted
                                    else dict.fromkeys(("total", "p50", "p95", "max")))
            side["chars"] = {**_distribution(sorted(self.chars[i])), "max": self.max_chars[i]}
            out[name] = side
        return out


@dataclass
class Validator:
    """Streaming validator; ``feed`` every line (with its newline or not), then ``finish``."""

    max_seq_len: int = HYPERPARAMETER_DEFAULTS["max_seq_len"]
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
    # the file's format (CHAT or PREFERENCE) is the reader's: set by the first line that is a JSON
    # object holding either's keys
    reader: LineReader = field(default_factory=LineReader, init=False)
    _seen: dict[bytes, int] = field(default_factory=dict)
    # (line, conversations to count: 1 for chat, 2 for a pair, weight, is a pair, tool schemas or None)
    _pending: list[tuple[int, list[list[dict[str, Any]]], int, bool, list[dict[str, Any]] | None]] = \
        field(default_factory=list)
    _tool_lines: int = 0          # lines that declare tools
    _tool_calls: int = 0          # the calls their assistant messages make
    _calling_lines: int = 0       # lines with at least one call
    _max_calls: int = 0
    _sample: list[tuple[int, int]] = field(default_factory=list)   # (tokens, weight)
    _assistant_tokens: int = 0
    _sides: _Sides = field(default_factory=_Sides)

    def _error(self, line: int | None, kind: str, message: str) -> None:
        self.error_counts[kind] += 1
        if len(self.errors) < self.max_errors:
            self.errors.append(Issue(line, kind, message))

    def _warn(self, line: int | None, kind: str, message: str) -> None:
        self.warning_counts[kind] += 1
        if len(self.warnings) < self.max_errors:
            self.warnings.append(Issue(line, kind, message))

    def feed(self, lineno: int, raw: bytes, length: int | None = None) -> Example | None:
        """Check one line (1-based ``lineno``); ``length`` is its true size when ``raw``
        was cut short because the line is over ``max_line_bytes``. Returns the line's example,
        or None when it is blank or refused (its error recorded)."""
        self.lines = lineno
        size = len(raw) if length is None else length
        if size > self.max_line_bytes:
            self._error(lineno, Kind.LINE_TOO_LONG,
                        f"line is {size} bytes; the limit is {self.max_line_bytes}")
            return None
        try:
            example = self.reader.read(lineno, raw)
        except LineError as e:
            self._error(lineno, e.kind, e.message)
            return None
        if example is None:
            return None  # blank lines are ignored
        if isinstance(example, Preference):
            self._sides.add_chars(example, _sample_weight(self.examples))
        self._accept(lineno, raw.rstrip(b"\r\n"), example)
        return example

    def _accept(self, lineno: int, raw: bytes, example: Example) -> None:
        index = self.examples
        self.examples += 1
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        first = self._seen.setdefault(digest, lineno)
        if first != lineno:
            self._warn(lineno, Warn.DUPLICATE, f"exact duplicate of line {first}")
        if example.chars < SHORT_CHARS:
            what = "pair (prompt + shorter side under" if isinstance(example, Preference) else "example (under"
            self._warn(lineno, Warn.VERY_SHORT, f"very short {what} {SHORT_CHARS} characters of content)")
        tools = example.tool_schemas()
        if tools:
            calls = example.calls if isinstance(example, Chat) else 0
            self._tool_lines += 1
            self._tool_calls += calls
            self._calling_lines += 1 if calls else 0
            self._max_calls = max(self._max_calls, calls)
        if self.counter is None:
            return
        convs: list[list[dict[str, Any]]] = example.conversations()
        weight = _sample_weight(index)
        bound = self._bound(convs) if weight == 0 and not tools else None
        if weight or bound is None or bound > self.max_seq_len:
            # counted exactly: sampled for statistics, or possibly over the length limit
            self._pending.append((lineno, convs, weight, isinstance(example, Preference), tools))
            if len(self._pending) >= TOKEN_BATCH:
                self._count_tokens()

    def _bound(self, convs: list[list[dict[str, Any]]]) -> int | None:
        """The counter's bound on the longest of ``convs``; None if any has none."""
        assert self.counter is not None
        longest = 0
        for conv in convs:
            b = self.counter.bound(conv)
            if b is None:
                return None
            longest = max(longest, b)
        return longest

    def _count_tokens(self) -> None:
        assert self.counter is not None
        convs_all = [c for _, convs, _, _, _ in self._pending for c in convs]
        if any(tools for *_, tools in self._pending):
            counts = self.counter.count(convs_all, tools=[t for _, convs, _, _, t in self._pending for _ in convs])
        else:
            counts = self.counter.count(convs_all)
        self.exact_checks += len(counts)
        at = 0
        for lineno, convs, weight, is_pair, _ in self._pending:
            got = counts[at:at + len(convs)]
            at += len(convs)
            if weight:
                self._sample.append((sum(t for t, _ in got), weight))
                self._assistant_tokens += sum(a for _, a in got) * weight
                if is_pair:
                    for side, (total, _) in zip(self._sides.tokens, got, strict=True):
                        side.append((total, weight))
            longest = max(t for t, _ in got)
            if longest > self.max_seq_len:
                what = "prompt + longer side is" if is_pair else "example is"
                self._error(lineno, Kind.TOO_LONG, f"{what} {longest} tokens; the maximum "
                            f"sequence length is {self.max_seq_len}")
        assert at == len(counts), "the counter returned a count per conversation"
        self._pending.clear()

    def _token_stats(self) -> dict[str, Any] | None:
        if self.counter is None:
            return None
        pairs = sorted(self._sample)
        exact = self.examples <= EXACT_FIRST
        return {"total": sum(t * w for t, w in pairs), **_distribution(pairs),
                "assistant": self._assistant_tokens, "exact": exact,
                "sampled_examples": len(pairs)}

    def _tool_stats(self) -> dict[str, Any] | None:
        """Tool calling in the file: lines that declare tools, their calls; None when none does."""
        if not self._tool_lines:
            return None
        return {"lines_with_tools": self._tool_lines, "lines_with_calls": self._calling_lines,
                "tool_calls": self._tool_calls,
                "calls_per_line": round(self._tool_calls / self._tool_lines, 2),
                "max_calls_per_line": self._max_calls}

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
            "format": self.reader.format or CHAT,
            "tokenizer": self.counter.name if self.counter else None,
            "tokens": tokens,
            "preference": (self._sides.report(self.examples, self.counter is not None)
                           if self.reader.format == PREFERENCE else None),
            "tools": self._tool_stats(),
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
