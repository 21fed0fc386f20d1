"""The pure streaming validator: every error class with its line number, warnings, stats."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.datasets.validation import LineSplitter, Validator, validate_lines, validate_stream

DATASETS = Path(__file__).parent.parent / "data" / "datasets"
EXPECTED: dict[str, dict[str, Any]] = json.loads((DATASETS / "expected.json").read_text())


class WordCounter:
    """Counts whitespace-separated words: enough to test the length logic without a model."""

    name = "words"

    def count(self, conversations: Sequence[list[dict[str, Any]]]) -> list[tuple[int, int]]:
        return [(sum(len(m["content"].split()) + 3 for m in c),
                 sum(len(m["content"].split()) for m in c if m["role"] == "assistant"))
                for c in conversations]

    def bound(self, messages: list[dict[str, Any]]) -> int | None:
        return None


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_error_class_with_its_line(name: str) -> None:
    want = EXPECTED[name]
    data = (DATASETS / name).read_bytes()
    report = validate_stream([data], counter=WordCounter(), max_seq_len=200)
    assert not report["ok"]
    assert report["error_counts"] == {want["kind"]: 1}, report["errors"]
    assert report["errors"][0]["line"] == want["line"]


def test_messages_never_quote_the_data() -> None:
    secret = "CANARY-7f3a"
    lines = [json.dumps({"messages": [{"role": secret, "content": "x"}]}).encode(),
             json.dumps({"messages": [{"role": "user", "content": secret}], secret: 1}).encode(),
             (secret + " not json").encode()]
    report = validate_lines(lines)
    assert secret not in json.dumps(report)


def test_warnings_and_stats() -> None:
    report = validate_stream([(DATASETS / "warnings_only.jsonl").read_bytes()], counter=WordCounter())
    assert report["ok"]
    assert report["warning_counts"] == {"duplicate_example": 1, "very_short_example": 1}
    dup = next(w for w in report["warnings"] if w["kind"] == "duplicate_example")
    assert dup == {"line": 11, "kind": "duplicate_example", "message": "exact duplicate of line 4"}
    s = report["stats"]
    assert s["examples"] == 12 and s["tokens"]["max"] >= s["tokens"]["p95"] >= s["tokens"]["p50"] > 0
    assert s["estimated_training_tokens"] == 3 * s["tokens"]["total"]


def test_without_tokenizer_lengths_are_reported_unchecked() -> None:
    report = validate_stream([(DATASETS / "warnings_only.jsonl").read_bytes()])
    assert report["ok"] and "tokens_not_checked" in report["warning_counts"]
    assert report["stats"]["tokens"] is None


@pytest.mark.parametrize("seed", range(5))
def test_chunk_boundaries_do_not_matter(seed: int) -> None:
    data = b"".join((DATASETS / n).read_bytes() for n in ("bad_role.jsonl", "not_utf8.jsonl"))
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(data):
        n = rng.randint(1, 300)
        chunks.append(data[i:i + n])
        i += n
    assert validate_stream(chunks) == validate_stream([data])


def test_overlong_line_is_cut_not_buffered() -> None:
    v = Validator(max_line_bytes=1000)
    s = LineSplitter(v)
    for _ in range(1000):
        s.feed(b"a" * 1000)           # one 1 MB line, fed in 1 KB chunks
        assert len(s.rest) <= 1001
    s.feed(b"\n")
    report = s.finish()
    assert report["errors"][0] == {"line": 1, "kind": "line_too_long",
                                   "message": "line is 1000000 bytes; the limit is 1000"}


def test_blank_lines_ignored_and_crlf_accepted() -> None:
    good = json.dumps({"messages": [{"role": "user", "content": "hello"},
                                    {"role": "assistant", "content": "hi there"}]})
    data = ("\r\n".join(f'{{"messages": [{{"role": "user", "content": "q{i}"}}, '
                        f'{{"role": "assistant", "content": "answer {i}"}}]}}' for i in range(10))
            + "\r\n\r\n" + good + "\n").encode()
    report = validate_stream([data])
    assert report["ok"] and report["stats"]["examples"] == 11


@pytest.mark.parametrize(("line", "kind"), [
    (b'{"messages": [{"role": "assistant", "content": "hi"}]}', "role_order"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}', "role_order"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0}]}',
     "no_assistant"),
    (b'{"messages": [{"role": "user", "content": "a", "weight": 1}, {"role": "assistant", "content": "b"}]}',
     "bad_weight"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": true}]}',
     "bad_weight"),
    (b'{"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]}', "bad_content"),
    (b'{"messages": [{"role": "user", "content": "a", "name": null}, {"role": "assistant", "content": "b"}]}',
     "bad_name"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": null}]}',
     "bad_weight"),
    (b'{"messages": [{"role": "user", "content": "' + b"1" * 5000 + b'"}], "x": ' + b"1" * 5000 + b"}", "not_json"),
    (b'{"messages": {"role": "user"}}', "missing_messages"),
    (b'{"prompt": "x", "completion": "y"}', "unknown_key"),
    (b'"just a string"', "not_object"),
    (b"[" * 5000 + b"]" * 5000, "not_json"),
])
def test_more_cases(line: bytes, kind: str) -> None:
    report = validate_lines([line])
    assert report["errors"][0]["kind"] == kind and report["errors"][0]["line"] == 1
