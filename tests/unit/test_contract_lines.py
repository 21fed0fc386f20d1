"""One line grammar: what the gateway's validator accepts, the trainer reads the same; what it
refuses, the trainer refuses (issue 30).

Generated lines of both formats, valid and broken (roles and their order, missing and extra keys,
``name``, weights, content types, bad JSON and UTF-8, lone surrogates, blank lines, mixed
formats), each put second in a file of either format after a valid line, go through both real
entry points: ``Validator.feed`` (what an upload's ``LineSplitter`` calls per line) and the
trainer's ``read_conversations`` / ``read_pairs`` on the file written to disk. Lines over the
gateway's ``max_line_bytes`` (a size limit of the upload, not a grammar rule) are not generated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.datasets.validation import Validator
from trainer.contract.errors import DatasetError
from trainer.contract.lines import CHAT, PREFERENCE, Chat, LineReader, check_example, check_pair, decode
from trainer.contract.lines import Preference as PreferenceLine
from trainer.contract.lines import _fast as fast_path
from trainer.data import read_conversations
from trainer.dpo import read_pairs

PROPERTY = settings(max_examples=400, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SURROGATE = "@@surrogate@@"   # replaced by the JSON escape of a lone surrogate after encoding
ANCHOR: dict[str, dict[str, Any]] = {
    CHAT: {"messages": [{"role": "user", "content": "anchor question"},
                        {"role": "assistant", "content": "anchor answer"}]},
    PREFERENCE: {"input": {"messages": [{"role": "user", "content": "anchor question"}]},
                 "preferred_output": [{"role": "assistant", "content": "yes"}],
                 "non_preferred_output": [{"role": "assistant", "content": "no"}]},
}

TEXT = st.one_of(st.text(max_size=10), st.sampled_from(["", " ", "\t\n", "héllo ✓", "日本"]))
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.floats(allow_nan=True), TEXT,
                 st.lists(st.integers(0, 1), max_size=2), st.dictionaries(st.sampled_from(["a", "role"]),
                                                                          st.integers(0, 1), max_size=1))
ROLE = st.sampled_from(["system", "user", "assistant"] * 2 + ["tool", "User", ""])
WEIGHT = st.one_of(st.sampled_from([0, 1]), JUNK, st.sampled_from([1.0, 0.0, 10**30]))


def _mutate_message(draw: st.DrawFn, m: dict[str, Any]) -> Any:
    what = draw(st.sampled_from(["role", "no_role", "content", "no_content", "weight", "name", "extra", "junk",
                                 "surrogate"]))
    if what == "surrogate":
        m[draw(st.sampled_from(["content", "name"]))] = "a" + SURROGATE
    elif what == "role":
        m["role"] = draw(ROLE)
    elif what in ("no_role", "no_content"):
        m.pop(what[3:], None)
    elif what == "content":
        m["content"] = draw(JUNK)
    elif what == "weight":
        m["weight"] = draw(WEIGHT)
    elif what == "name":
        m["name"] = draw(st.one_of(TEXT, JUNK))
    elif what == "extra":
        m[draw(st.sampled_from(["tool_calls", "Role", "weights"]))] = 1
    else:
        return draw(JUNK)
    return m


@st.composite
def messages(draw: st.DrawFn, prompt: bool) -> list[Any]:
    """A conversation in the chat order (a prompt: ending with the user), then 0-2 mutations."""
    turns = draw(st.integers(0, 2)) * 2 + (1 if prompt else draw(st.sampled_from([1, 2])))
    roles = ["system"] * draw(st.booleans()) + [("user", "assistant")[i % 2] for i in range(turns)]
    out: list[Any] = []
    for role in roles:
        m: dict[str, Any] = {"role": role, "content": draw(TEXT)}
        if role == "assistant" and not prompt and draw(st.integers(0, 2)) == 0:
            m["weight"] = draw(st.sampled_from([0, 1]))
        if draw(st.integers(0, 3)) == 0:
            m["name"] = draw(TEXT)
        out.append(m)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        how = draw(st.sampled_from(["message", "message", "swap", "drop", "add"]))
        i = draw(st.integers(0, max(len(out) - 1, 0)))
        if how == "message" and out and isinstance(out[i], dict):
            out[i] = _mutate_message(draw, out[i])
        elif how == "swap" and len(out) > 1:
            j = draw(st.integers(0, len(out) - 1))
            out[i], out[j] = out[j], out[i]
        elif how == "drop" and out:
            out.pop(i)
        else:
            out.insert(i, {"role": draw(ROLE), "content": draw(TEXT)})
    return out


@st.composite
def chat_obj(draw: st.DrawFn) -> Any:
    obj: dict[str, Any] = {"messages": draw(messages(prompt=False))}
    how = draw(st.sampled_from(["none"] * 12 + ["extra", "junk_messages", "no_messages", "junk"]))
    if how == "extra":
        obj[draw(st.sampled_from(["prompt", "tools", "input"]))] = 1
    elif how == "junk_messages":
        obj["messages"] = draw(JUNK)
    elif how == "no_messages":
        del obj["messages"]
    elif how == "junk":
        return draw(JUNK)
    return obj


def _side(content: str) -> list[Any]:
    return [{"role": "assistant", "content": content}]


@st.composite
def pair_obj(draw: st.DrawFn) -> Any:
    chosen = ("yes " if draw(st.integers(0, 5)) else "") + draw(TEXT)
    rejected = chosen if draw(st.integers(0, 8)) == 0 else ("no " if draw(st.integers(0, 5)) else "") + draw(TEXT)
    obj: dict[str, Any] = {"input": {"messages": draw(messages(prompt=True))},
                           "preferred_output": _side(chosen), "non_preferred_output": _side(rejected)}
    how = draw(st.sampled_from(["none"] * 18 + ["extra", "tools", "no_key", "junk_input", "side", "side_key",
                                               "side_role", "two", "junk_side"]))
    key = draw(st.sampled_from(["preferred_output", "non_preferred_output"]))
    if how == "extra":
        obj["messages"] = []
    elif how == "tools":
        obj["input"]["tools"] = []
    elif how == "no_key":
        del obj[draw(st.sampled_from(["input", key]))]
    elif how == "junk_input":
        obj["input"] = draw(JUNK)
    elif how == "side":
        obj[key][0]["content"] = draw(JUNK)
    elif how == "side_key":
        obj[key][0][draw(st.sampled_from(["name", "weight"]))] = draw(TEXT)
    elif how == "side_role":
        obj[key][0]["role"] = draw(ROLE)
    elif how == "two":
        obj[key] = obj[key] * 2
    elif how == "junk_side":
        obj[key] = draw(JUNK)
    return obj


@st.composite
def line(draw: st.DrawFn, fmt: str) -> bytes:
    """One line's bytes (no newline): an object of the file's format ``fmt`` encoded as JSON (one
    in eight of the other format), sometimes broken."""
    other = draw(st.integers(0, 7)) == 0
    obj = draw(pair_obj() if (fmt == PREFERENCE) != other else chat_obj())
    raw = json.dumps(obj, ensure_ascii=draw(st.booleans())).encode()
    raw = raw.replace(SURROGATE.encode(), b"\\ud800")
    how = draw(st.sampled_from(["none"] * 32 + ["cut", "byte", "blank", "space", "cr", "nbsp", "bom", "garbage"]))
    if how == "cut":
        raw = raw[:draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif how == "byte":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + raw[at:]
    elif how == "blank":
        raw = draw(st.sampled_from([b"", b"   ", b"\t", b"\r", b"\x0b\x0c"]))
    elif how == "space":
        raw = b"  " + raw + b" \t"
    elif how == "cr":
        raw += b"\r"
    elif how == "nbsp":
        raw = b"\xc2\xa0" if draw(st.booleans()) else b"\xc2\xa0" + raw
    elif how == "bom":
        raw = b"\xef\xbb\xbf" + raw
    elif how == "garbage":
        raw = draw(st.sampled_from([b"[", b"nul", b"{}", b"[]", b'"text"', b"1" * 5000, b"NaN", b'{"a": 1} 2']))
    assert b"\n" not in raw
    return raw


def _gateway(fmt: str, raw: bytes) -> tuple[Chat | PreferenceLine | None, list[str]]:
    """What the upload validator makes of ``raw`` as line 2 of a file of ``fmt``: its example (None:
    blank or refused) and its error classes at that line."""
    v = Validator(min_examples=1)
    v.feed(1, json.dumps(ANCHOR[fmt]).encode())
    examples = v.examples
    example = v.feed(2, raw)
    kinds = [e.kind for e in v.errors if e.line == 2]
    assert (example is not None) == (v.examples > examples) and not (example and kinds)
    return example, kinds


def _trainer(fmt: str, raw: bytes, path: Path) -> tuple[list[Any], str | None]:
    """What the trainer's reader makes of ``raw`` as line 2 of a file of ``fmt``: its records
    ([] when refused) and the error class its DatasetError names (None: read)."""
    path.write_bytes(json.dumps(ANCHOR[fmt]).encode() + b"\n" + raw + b"\n")
    try:
        records = read_conversations(path, "train") if fmt == CHAT else read_pairs(path, "train")
    except DatasetError as e:
        found = re.fullmatch(r"train dataset line 2: .* \((\w+)\)", str(e), re.S)
        assert found, f"the trainer's error names neither line 2 nor a class: {e}"
        return [], found.group(1)
    return records, None


def _messages_of(example: Chat | PreferenceLine) -> tuple[Any, ...]:
    return example.messages if isinstance(example, Chat) else example.prompt


def _as_read(fmt: str, example: Chat | PreferenceLine) -> tuple[Any, ...]:
    """The gateway's example as the trainer's record holds it."""
    if isinstance(example, Chat):
        return (example.conversations()[0], example.weights)
    return ([m.turn() for m in example.prompt], example.chosen, example.rejected)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lines") / "data.jsonl"


@PROPERTY
@given(data=st.data())
def test_the_trainer_reads_what_the_gateway_accepts_and_refuses_what_it_refuses(
        data: st.DataObject, data_file: Path) -> None:
    fmt = data.draw(st.sampled_from([CHAT, PREFERENCE]))
    raw = data.draw(line(fmt))
    example, kinds = _gateway(fmt, raw)
    records, refused = _trainer(fmt, raw, data_file)
    event(f"{fmt} file: {kinds[0] if kinds else 'blank' if example is None else 'accepted'}")
    if example is not None and any(m.name for m in _messages_of(example)):
        event("accepted with a name")
    if kinds:
        assert refused == kinds[0], f"the gateway refuses ({kinds}), the trainer says {refused}"
        return
    assert refused is None, f"the gateway accepts, the trainer refuses ({refused})"
    if example is None:
        assert len(records) == 1, "a blank line for the gateway is one for the trainer"
        return
    assert len(records) == 2 and records[1].line == 2
    got = records[1]
    want = _as_read(fmt, example)
    if fmt == CHAT:
        assert (got.messages, got.weights) == want
    else:
        assert (got.prompt, got.chosen, got.rejected) == want


@PROPERTY
@given(data=st.data())
def test_the_fast_path_accepts_only_what_the_detailed_checks_accept(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from([CHAT, PREFERENCE]))
    raw = data.draw(line(fmt))
    fast = fast_path(raw.rstrip(b"\r\n"), fmt)
    if fast is not None:
        assert fast == (check_pair if fmt == PREFERENCE else check_example)(decode(raw))


def _lines(path: Path, *objs: Any) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def test_a_name_is_accepted_by_both_sides_and_rendered_by_neither(tmp_path: Path) -> None:
    named = {"messages": [{"role": "system", "content": "Be brief.", "name": "rules"},
                          {"role": "user", "content": "Hi there", "name": "ann"},
                          {"role": "assistant", "content": "Hello.", "name": "bot"}]}
    example, kinds = _gateway(CHAT, json.dumps(named).encode())
    assert kinds == [] and isinstance(example, Chat) and example.messages[1].name == "ann"
    assert example.conversations() == [[{"role": m["role"], "content": m["content"]} for m in named["messages"]]]
    [conv] = read_conversations(_lines(tmp_path / "c.jsonl", named), "train")
    assert conv.messages == example.conversations()[0] and conv.weights == [1]
    pair = {**ANCHOR[PREFERENCE], "input": {"messages": [{"role": "user", "content": "Hi", "name": "ann"}]}}
    [pref] = read_pairs(_lines(tmp_path / "p.jsonl", pair), "train")
    assert pref.prompt == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(("obj", "kind"), [
    ({"messages": [{"role": "user", "content": "a", "name": 7}, {"role": "assistant", "content": "b"}]},
     "bad_name"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                   {"role": "assistant", "content": "c"}]}, "role_order"),
    ({"messages": [{"role": "assistant", "content": "c"}]}, "role_order"),
])
def test_the_trainer_refuses_with_the_gateways_class(tmp_path: Path, obj: Any, kind: str) -> None:
    assert _gateway(CHAT, json.dumps(obj).encode()) == (None, [kind])
    with pytest.raises(DatasetError, match=rf"^train dataset line 1: .* \({kind}\)$"):
        read_conversations(_lines(tmp_path / "d.jsonl", obj), "train")


def test_a_number_past_pythons_digit_limit_is_not_json_not_a_crash() -> None:
    reader = LineReader()
    with pytest.raises(DatasetError) as e:
        reader.read(1, b'{"messages": [{"role": "assistant", "content": "x", "weight": ' + b"1" * 5000 + b"}]}")
    assert getattr(e.value, "kind", None) == "not_json"


@pytest.mark.parametrize("message", [b'"content": "a\\ud800"', b'"content": "a", "weight": null',
                                     b'"content": "a", "name": null', b'"content": "a", "weight": true'])
def test_the_fast_path_leaves_nulls_booleans_and_lone_surrogates_to_the_detailed_checks(message: bytes) -> None:
    raw = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", ' + message + b"}]}"
    assert fast_path(raw, CHAT) is None
    with pytest.raises(DatasetError):
        LineReader(CHAT).read(1, raw)
