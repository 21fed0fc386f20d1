"""Preference (DPO) files through the same streaming validator: each error class at its
line, per-side statistics, one format per file, the length rule on both sequences."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import pytest

from gateway.datasets.validation import LineSplitter, Validator, validate_lines, validate_stream

CANARY = "CANARY-9b1e"


class WordCounter:
    """Counts whitespace-separated words (+3 per message); its bound is the content's
    characters (+3 per message), a true upper bound, when ``with_bound``."""

    name = "words"

    def __init__(self, with_bound: bool = False):
        self.with_bound = with_bound

    def count(self, conversations: Sequence[list[dict[str, Any]]]) -> list[tuple[int, int]]:
        return [(sum(len(m["content"].split()) + 3 for m in c),
                 sum(len(m["content"].split()) for m in c if m["role"] == "assistant"))
                for c in conversations]

    def bound(self, messages: list[dict[str, Any]]) -> int | None:
        return sum(len(m["content"]) + 3 for m in messages) if self.with_bound else None


def pair(i: int = 0, chosen: str = "Four.", rejected: str = "It is five, I think.",
         **over: Any) -> dict[str, Any]:
    """A good preference example (prompt: 3 words), with top-level keys replaced by ``over``."""
    ex: dict[str, Any] = {"input": {"messages": [{"role": "user", "content": f"question {i} please"}]},
                          "preferred_output": [{"role": "assistant", "content": chosen}],
                          "non_preferred_output": [{"role": "assistant", "content": rejected}]}
    ex.update(over)
    return ex


def enc(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def prompt(*messages: Any, **extra: Any) -> dict[str, Any]:
    return {"input": {"messages": list(messages), **extra}}


U = {"role": "user", "content": f"ask {CANARY}"}
A = {"role": "assistant", "content": f"said {CANARY}"}
SIDE = [{"role": "assistant", "content": f"fine {CANARY}"}]

# One bad line per case; every one plants the canary. (kind, raw line)
BAD: list[tuple[str, bytes]] = [
    ("not_utf8", enc(pair(1, rejected="@@" + CANARY)).replace(b"@@", b"\xff")),
    ("not_utf8", enc(pair(2, rejected=CANARY + " \ud800"))),
    ("not_json", f'{{"input": {CANARY}'.encode()),
    ("not_object", enc([CANARY])),
    ("unknown_key", enc({**pair(3), CANARY: 1})),
    ("unknown_key", enc({"prompt": CANARY})),
    ("unknown_key", enc(pair(4, **prompt(U, tools=[{"type": "function", "function": {"name": CANARY}}])))),
    ("unknown_key", enc(pair(5, **prompt({**U, CANARY: 1})))),
    ("missing_messages", enc(pair(6, **prompt()))),
    ("missing_messages", enc({k: v for k, v in pair(7).items() if k != "input"})),
    ("not_object", enc(pair(8, input=[U]))),
    ("message_not_object", enc(pair(9, **prompt(CANARY)))),
    ("bad_role", enc(pair(10, **prompt({"role": CANARY, "content": "x"})))),
    ("bad_content", enc(pair(11, **prompt({"role": "user", "content": [CANARY]})))),
    ("bad_content", enc(pair(12, preferred_output=[{"role": "assistant", "content": {CANARY: 1}}]))),
    ("role_order", enc(pair(13, **prompt(U, A)))),                  # must end with the user turn
    ("role_order", enc(pair(14, **prompt(A, U)))),
    ("role_order", enc(pair(15, **prompt({"role": "system", "content": CANARY})))),
    ("bad_weight", enc(pair(16, **prompt({**U, "weight": 1})))),
    ("bad_weight", enc(pair(17, **prompt(U, {**A, "weight": 0}, U)))),
    ("missing_side", enc({k: v for k, v in pair(18, chosen=CANARY).items() if k != "non_preferred_output"})),
    ("missing_side", enc(pair(19, preferred_output=[]))),
    ("missing_side", enc(pair(20, preferred_output=CANARY))),
    ("missing_side", enc(pair(21, rejected=" \n\t "))),
    ("identical_sides", enc(pair(22, chosen=CANARY, rejected=CANARY))),
    ("bad_output", enc(pair(23, preferred_output=SIDE + SIDE))),
    ("bad_output", enc(pair(24, non_preferred_output=[{"role": "user", "content": CANARY}]))),
    ("bad_output", enc(pair(25, non_preferred_output=[{"role": CANARY, "content": "x"}]))),
    ("bad_output", enc(pair(26, preferred_output=[{**SIDE[0], CANARY: 1}]))),
    ("bad_output", enc(pair(27, preferred_output=[{**SIDE[0], "weight": 1}]))),
    ("bad_output", enc(pair(28, preferred_output=[CANARY]))),
    ("mixed_format", enc({"messages": [U, A]})),                      # a well-formed chat line
    ("mixed_format", enc({"messages": [A], CANARY: 1})),              # a broken one
    ("example_too_long", enc(pair(29, rejected=f"{CANARY} " * 300))),
]
MAX = 200


def bad_file() -> tuple[list[bytes], list[tuple[int, str]]]:
    """A good pair first (it sets the format), then each bad line between good ones."""
    lines, want = [enc(pair(100))], []
    for n, (kind, raw) in enumerate(BAD):
        lines.append(raw)
        want.append((len(lines), kind))
        lines.append(enc(pair(200 + n)))
    return lines, want


def test_each_error_class_at_its_own_line() -> None:
    lines, want = bad_file()
    report = validate_lines(lines, counter=WordCounter(), max_seq_len=MAX)
    assert not report["ok"] and report["stats"]["format"] == "preference"
    assert [(e["line"], e["kind"]) for e in report["errors"]] == want
    assert {"missing_side", "identical_sides", "bad_output", "mixed_format"} <= report["error_counts"].keys()
    assert report["stats"]["examples"] == len(BAD) + 1 + 1   # the good pairs and the well-formed long one
    too_long = next(e for e in report["errors"] if e["kind"] == "example_too_long")
    assert too_long["message"] == f"prompt + longer side is 309 tokens; the maximum sequence length is {MAX}"
    tools = next(e for e in report["errors"] if e["line"] == want[6][0])
    assert "a preference pair takes no tools" in tools["message"]


def test_messages_never_quote_the_data() -> None:
    lines, _ = bad_file()
    for counter in (WordCounter(), None):
        report = validate_lines(lines, counter=counter, max_seq_len=MAX)
        assert len(report["errors"]) == len(BAD) - (counter is None)   # no length check without one
        assert CANARY not in json.dumps(report)


def good_lines(n: int) -> list[bytes]:
    return [enc(pair(i)) for i in range(n)]


def test_a_good_file_passes_with_per_side_statistics() -> None:
    report = validate_lines(good_lines(12), counter=WordCounter())
    assert report["ok"] and report["errors"] == [] and report["warnings"] == []
    s = report["stats"]
    assert s["format"] == "preference" and s["examples"] == 12
    # prompt 3 words + 3; chosen 1 word + 3; rejected 5 words + 3
    assert s["preference"] == {
        "pairs": 12,
        "chosen": {"total": 12 * 10, "p50": 10, "p95": 10, "max": 10, "chars": {"p50": 5, "p95": 5, "max": 5}},
        "rejected": {"total": 12 * 14, "p50": 14, "p95": 14, "max": 14,
                     "chars": {"p50": 20, "p95": 20, "max": 20}},
    }
    tok = s["tokens"]    # a pair trains on both its sequences
    assert (tok["total"], tok["p50"], tok["max"], tok["assistant"]) == (12 * 24, 24, 24, 12 * 6)
    assert s["estimated_training_tokens"] == 3 * tok["total"]


def test_without_tokenizer_sides_get_character_statistics() -> None:
    lines = good_lines(20) + [enc(pair(99, rejected="No. " * 40))]
    report = validate_lines(lines)
    assert report["ok"] and report["warning_counts"] == {"tokens_not_checked": 1}
    s = report["stats"]
    assert s["tokens"] is None and s["estimated_training_tokens"] is None
    rejected = s["preference"]["rejected"]
    assert {k: rejected[k] for k in ("total", "p50", "p95", "max")} == dict.fromkeys(("total", "p50", "p95", "max"))
    assert rejected["chars"] == {"p50": 20, "p95": 20, "max": 160}
    assert s["preference"]["chosen"]["chars"] == {"p50": 5, "p95": 5, "max": 5}


def test_system_prompt_multi_turn_and_names_are_accepted() -> None:
    ex = pair(0, input={"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi there", "name": "ann"},
                                     {"role": "assistant", "content": "Hello."},
                                     {"role": "user", "content": "Two plus two?"}]})
    report = validate_lines([enc(ex)] + good_lines(10))
    assert report["ok"] and report["stats"]["examples"] == 11


def test_duplicate_and_very_short_pairs_are_warnings() -> None:
    short = pair(0, input={"messages": [{"role": "user", "content": "hi"}]}, chosen="ok", rejected="no way")
    lines = good_lines(10)
    lines[3:3] = [enc(short)]
    lines.append(lines[5])
    report = validate_lines(lines, counter=WordCounter())
    assert report["ok"] and report["warning_counts"] == {"duplicate_example": 1, "very_short_example": 1}
    assert {(w["line"], w["kind"]) for w in report["warnings"]} == {(4, "very_short_example"),
                                                                     (12, "duplicate_example")}
    assert next(w["message"] for w in report["warnings"] if w["line"] == 12) == "exact duplicate of line 6"


def test_a_chat_file_refuses_a_preference_line() -> None:
    chat = [enc({"messages": [{"role": "user", "content": f"q{i}"},
                              {"role": "assistant", "content": f"answer {i}"}]}) for i in range(11)]
    report = validate_lines(chat[:2] + [enc(pair(1)), enc({"preferred_output": []})] + chat[2:])
    assert [(e["line"], e["kind"]) for e in report["errors"]] == [(3, "mixed_format"), (4, "mixed_format")]
    assert report["errors"][0]["message"] == ("a preference example in a chat file (the format was set "
                                              "by line 1); a file holds one format only")
    assert report["stats"]["format"] == "chat" and report["stats"]["preference"] is None


def test_the_first_json_object_with_either_formats_keys_sets_the_format() -> None:
    lines = [b"not json", b'"a string"', enc({"prompt": "x"}), *good_lines(10),
             enc({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})]
    report = validate_lines(lines)
    assert [(e["line"], e["kind"]) for e in report["errors"]] == [
        (1, "not_json"), (2, "not_object"), (3, "unknown_key"), (14, "mixed_format")]
    assert report["stats"]["format"] == "preference" and report["stats"]["examples"] == 10
    assert "set by line 4" in report["errors"][-1]["message"]


@pytest.mark.parametrize("lines", [[], [b"\n", b"  \n"]])
def test_an_empty_file_reports_chat(lines: list[bytes]) -> None:
    report = validate_lines(lines)
    assert report["error_counts"] == {"empty_file": 1} and report["stats"]["format"] == "chat"


@pytest.mark.parametrize("with_bound", [False, True])
def test_length_rule_on_the_longer_sequence_outside_the_sample(with_bound: bool) -> None:
    n, limit = 2100, 100
    lines = good_lines(n)
    lines[1499] = enc(pair(1499, chosen="yes " * 95))                    # 6 + 98 = 104 tokens
    lines[2049] = enc(pair(2049, rejected="no " * 150))                  # 6 + 153 = 159 tokens
    lines[1999] = enc(pair(1999, chosen="a " * 90, rejected="b " * 90))  # 99 each: their sum is no limit
    counter = WordCounter(with_bound)
    report = validate_stream([b"\n".join(lines) + b"\n"], counter=counter, max_seq_len=limit)
    assert [(e["line"], e["kind"], e["message"]) for e in report["errors"]] == [
        (1500, "example_too_long", "prompt + longer side is 104 tokens; the maximum sequence length is 100"),
        (2050, "example_too_long", "prompt + longer side is 159 tokens; the maximum sequence length is 100")]
    tok = report["stats"]["tokens"]
    assert tok["exact"] is False and tok["sampled_examples"] < n
    assert report["stats"]["preference"]["pairs"] == n
    assert report["stats"]["preference"]["chosen"]["chars"]["max"] == len("yes " * 95)


def test_the_bound_skips_exact_counting_of_provably_short_pairs() -> None:
    data = b"\n".join(good_lines(3000)) + b"\n"
    counts = {}
    for with_bound in (False, True):
        v = Validator(counter=WordCounter(with_bound), max_seq_len=100)
        s = LineSplitter(v)
        s.feed(data)
        assert s.finish()["ok"]
        counts[with_bound] = v.exact_checks
    assert counts[False] == 2 * 3000               # both sequences of every pair
    assert counts[True] < counts[False] // 2       # only the statistics sample


@pytest.mark.parametrize("seed", range(3))
def test_chunk_boundaries_do_not_matter(seed: int) -> None:
    lines, _ = bad_file()
    data = b"\n".join(lines) + b"\n"
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(data):
        k = rng.randint(1, 300)
        chunks.append(data[i:i + k])
        i += k
    kw: dict[str, Any] = {"counter": WordCounter(), "max_seq_len": MAX}
    assert validate_stream(chunks, **kw) == validate_stream([data], **kw)
