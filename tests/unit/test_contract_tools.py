"""Tool calling in the line grammar (issue 34): OpenAI's ``tools``, ``tool_calls`` and ``tool``
messages, each mistake named at its line by the upload validator with the class the trainer's
reader names too, valid shapes accepted equal by the fast and detailed ways, and per-file
statistics. Generated mutations of a tool-calling line go through both sides as in
``test_contract_lines``."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from test_contract_lines import PROPERTY, _gateway, _trainer

from gateway.datasets.validation import Validator, validate_lines
from trainer.contract.lines import CHAT, Chat, check_example, decode
from trainer.contract.lines import _fast as fast_path
from trainer.toydata import TOY_TOOLS, toy_tool_conversations

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
GOOD: dict[str, Any] = {
    "messages": [{"role": "system", "content": "You help."},
                 {"role": "user", "content": "Weather in Oslo?"},
                 {"role": "assistant", "content": None, "tool_calls": [CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
                 {"role": "assistant", "content": "It is 3 degrees."}],
    "tools": TOY_TOOLS, "parallel_tool_calls": False}


def _with(change: Any) -> dict[str, Any]:
    line = copy.deepcopy(GOOD)
    change(line)
    return line


def _call(line: dict[str, Any]) -> dict[str, Any]:
    return line["messages"][2]["tool_calls"][0]


SECOND = {"id": "call_2", "type": "function", "function": {"name": "lookup_word", "arguments": '{"word": "x"}'}}

# (what is wrong, the line, the class named, where the message points)
MISTAKES: list[tuple[str, dict[str, Any], str, str]] = [
    ("tools not a list", _with(lambda d: d.update(tools={"get_weather": {}})), "bad_tools", "`tools`"),
    ("a tool without a name", _with(lambda d: d["tools"][0]["function"].pop("name")), "bad_tools",
     "tools[0].function.name"),
    ("a function declared twice", _with(lambda d: d["tools"].append(copy.deepcopy(d["tools"][0]))), "bad_tools",
     "tools[2]"),
    ("parameters not an object schema", _with(lambda d: d["tools"][0]["function"]["parameters"].update(type="array")),
     "bad_tools", "tools[0].function.parameters"),
    ("tool_calls on a user message", _with(lambda d: d["messages"][1].update(tool_calls=[CALL])), "bad_tool_call",
     "messages[1]"),
    ("a call without an id", _with(lambda d: _call(d).pop("id")), "bad_tool_call", "tool_calls[0].id"),
    ("a call of type code", _with(lambda d: _call(d).update(type="code")), "bad_tool_call", "tool_calls[0].type"),
    ("two calls with one id", _with(lambda d: (d.update(parallel_tool_calls=True),
                                              d["messages"][2]["tool_calls"].append({**SECOND, "id": "call_1"}))),
     "bad_tool_call", "tool_calls[1].id"),
    ("two calls though parallel_tool_calls is false",
     _with(lambda d: d["messages"][2]["tool_calls"].append(SECOND)), "bad_tool_call", "messages[2] makes 2 calls"),
    ("an undeclared function", _with(lambda d: _call(d)["function"].update(name="get_time")), "undeclared_function",
     "tool_calls[0]"),
    ("a call without any tools", _with(lambda d: d.pop("tools")), "undeclared_function", "declares no tools"),
    ("arguments not JSON", _with(lambda d: _call(d)["function"].update(arguments="{city: Oslo")), "bad_arguments",
     "function.arguments"),
    ("arguments a JSON list", _with(lambda d: _call(d)["function"].update(arguments='["Oslo"]')), "bad_arguments",
     "not an object"),
    ("arguments as an object, not text", _with(lambda d: _call(d)["function"].update(arguments={"city": "Oslo"})),
     "bad_arguments", "function.arguments"),
    ("a required argument missing", _with(lambda d: _call(d)["function"].update(arguments="{}")), "bad_arguments",
     "requires"),
    ("a tool answer to an unknown id", _with(lambda d: d["messages"][3].update(tool_call_id="call_9")),
     "unknown_tool_call_id", "messages[3].tool_call_id"),
    ("a call answered twice", _with(lambda d: d["messages"].insert(4, copy.deepcopy(d["messages"][3]))),
     "unknown_tool_call_id", "an answered call"),
    ("a tool message without tool_call_id", _with(lambda d: d["messages"][3].pop("tool_call_id")),
     "bad_tool_message", "messages[3]"),
    ("tool_call_id on a user message", _with(lambda d: d["messages"][1].update(tool_call_id="call_1")),
     "bad_tool_message", "messages[1]"),
    ("a call the user interrupts", _with(lambda d: d["messages"].__setitem__(3, {"role": "user", "content": "?"})),
     "unanswered_tool_call", "before messages[3]"),
    ("a tool answer with no call waiting", _with(lambda d: d["messages"].insert(2, {
        "role": "tool", "tool_call_id": "call_1", "content": "x"})), "unknown_tool_call_id", "messages[2]"),
    ("null content on a user message", _with(lambda d: d["messages"][1].update(content=None)), "bad_content",
     "messages[1].content is null"),
    ("the legacy functions format", _with(lambda d: d.update(functions=[])), "unknown_key", "legacy"),
    ("parallel_tool_calls not a boolean", _with(lambda d: d.update(parallel_tool_calls="no")), "bad_tools",
     "parallel_tool_calls"),
]


def test_every_mistake_is_named_at_its_line_by_the_validator_and_the_trainer(tmp_path: Path) -> None:
    """One file: a valid line, then each mistake on its own line between valid ones; the upload report
    names each at its line with its class, the tool-calling statistics count the valid lines, and the
    trainer refuses each mistake alone with the same class."""
    lines, want = [], {}
    for _, line, kind, where in MISTAKES:
        lines.append(json.dumps(GOOD).encode())
        lines.append(json.dumps(line).encode())
        want[len(lines)] = (kind, where)
    report = validate_lines(lines, min_examples=1)
    got = {e["line"]: (e["kind"], e["message"]) for e in report["errors"]}
    assert sorted(got) == sorted(want)
    for lineno, (kind, where) in want.items():
        assert got[lineno][0] == kind and where in got[lineno][1], (lineno, got[lineno], kind, where)
        assert "Oslo" not in got[lineno][1] and "get_weather" not in got[lineno][1]     # never the data
    assert len({kind for _, _, kind, _ in MISTAKES}) >= 9 and len(MISTAKES) >= 12
    assert report["stats"]["tools"] == {"lines_with_tools": len(MISTAKES), "lines_with_calls": len(MISTAKES),
                                        "tool_calls": len(MISTAKES), "calls_per_line": 1.0, "max_calls_per_line": 1}
    for _, line, kind, _ in MISTAKES:
        assert _trainer(CHAT, json.dumps(line).encode(), tmp_path / "one.jsonl") == ([], kind)


VALID: list[tuple[str, dict[str, Any]]] = [
    ("the OpenAI example", GOOD),
    ("content left out on the call", _with(lambda d: d["messages"][2].pop("content"))),
    ("text and a call together", _with(lambda d: d["messages"][2].update(content="Let me check."))),
    ("a conversation that ends on the call", _with(lambda d: d["messages"].__delitem__(slice(3, None)))),
    ("parallel calls answered in either order", _with(lambda d: (
        d.update(parallel_tool_calls=True), d["messages"][2]["tool_calls"].append(SECOND),
        d["messages"].insert(3, {"role": "tool", "tool_call_id": "call_2", "content": "y"})))),
    ("a call after a tool answer", _with(lambda d: d["messages"].insert(4, {
        "role": "assistant", "content": None, "tool_calls": [SECOND]}) or d["messages"].insert(
        5, {"role": "tool", "tool_call_id": "call_2", "content": "z"}))),
    ("weight 0 on the call", _with(lambda d: d["messages"][2].update(weight=0))),
    ("tools declared, none called", {"messages": GOOD["messages"][:2] + [{"role": "assistant", "content": "Hm."}],
                                    "tools": TOY_TOOLS}),
]


@pytest.mark.parametrize(("what", "line"), VALID, ids=[w for w, _ in VALID])
def test_valid_tool_lines_are_read_the_same_both_ways(what: str, line: dict[str, Any], tmp_path: Path) -> None:
    raw = json.dumps(line).encode()
    example, kinds = _gateway(CHAT, raw)
    assert kinds == [] and isinstance(example, Chat), what
    assert fast_path(raw, CHAT) == check_example(decode(raw)) == example
    records, refused = _trainer(CHAT, raw, tmp_path / "t.jsonl")
    assert refused is None
    assert records[1].messages == example.conversations()[0] and records[1].tools == example.tool_schemas()


def test_a_tool_answer_carries_its_call_id_and_function_name_to_the_template() -> None:
    example, _ = _gateway(CHAT, json.dumps(GOOD).encode())
    assert isinstance(example, Chat)
    turns = example.conversations()[0]
    assert turns[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert turns[3] == {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1", "name": "get_weather"}
    assert example.tool_schemas() == TOY_TOOLS


def test_a_preference_pair_with_tools_is_refused_by_name() -> None:
    pair = {"input": {"messages": [{"role": "user", "content": "q"}], "tools": TOY_TOOLS},
            "preferred_output": [{"role": "assistant", "content": "a"}],
            "non_preferred_output": [{"role": "assistant", "content": "b"}]}
    report = validate_lines([json.dumps(pair).encode()], min_examples=1)
    assert report["errors"][0]["kind"] == "unknown_key" and "takes no tools" in report["errors"][0]["message"]
    prompt_call = {**pair, "input": {"messages": [{"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                                  {"role": "tool", "tool_call_id": "call_1", "content": "x"},
                                                  {"role": "user", "content": "and?"}]}}
    report = validate_lines([json.dumps(prompt_call).encode()], min_examples=1)
    assert report["errors"][0]["kind"] == "unknown_key" and "takes no tools" in report["errors"][0]["message"]


def test_file_statistics_count_tool_lines_and_calls() -> None:
    rows = toy_tool_conversations(30, seed=3) + [{"messages": [{"role": "user", "content": "plain question"},
                                                               {"role": "assistant", "content": "plain answer"}]}]
    v = Validator(min_examples=1)
    for i, row in enumerate(rows, start=1):
        v.feed(i, json.dumps(row).encode())
    stats = v.finish(total_bytes=1)["stats"]
    assert stats["tools"] == {"lines_with_tools": 30, "lines_with_calls": 30, "tool_calls": 30,
                              "calls_per_line": 1.0, "max_calls_per_line": 1}
    assert validate_lines([json.dumps(rows[-1]).encode()], min_examples=1)["stats"]["tools"] is None


# ----------------------------------------------------------------- generated mutations

@st.composite
def tool_line(draw: st.DrawFn) -> bytes:
    """A valid tool-calling line with 0-2 mutations of its tool parts."""
    line = copy.deepcopy(draw(st.sampled_from([v for _, v in VALID])))
    for _ in range(draw(st.sampled_from([0, 1, 1, 2]))):
        msgs = line["messages"]
        i = draw(st.integers(0, len(msgs) - 1))
        how = draw(st.sampled_from(["drop_msg", "swap", "role", "call_key", "call_value", "tool_id", "content",
                                    "tools", "parallel", "arguments", "weight"]))
        calls = [c for m in msgs for c in m.get("tool_calls") or []]
        junk = draw(st.one_of(st.none(), st.integers(0, 2), st.text(max_size=4), st.just([]), st.just({})))
        if how == "drop_msg" and len(msgs) > 1:
            msgs.pop(i)
        elif how == "swap":
            j = draw(st.integers(0, len(msgs) - 1))
            msgs[i], msgs[j] = msgs[j], msgs[i]
        elif how == "role":
            msgs[i]["role"] = draw(st.sampled_from(["tool", "assistant", "user"]))
        elif how == "call_key" and calls:
            draw(st.sampled_from(calls)).pop(draw(st.sampled_from(["id", "type", "function"])), None)
        elif how == "call_value" and calls:
            draw(st.sampled_from(calls))[draw(st.sampled_from(["id", "type", "function"]))] = junk
        elif how == "tool_id":
            msgs[i]["tool_call_id"] = draw(st.one_of(st.sampled_from(["call_1", "call_2", "call_3"]), st.just(junk)))
        elif how == "content":
            msgs[i]["content"] = junk
        elif how == "tools":
            line["tools"] = draw(st.one_of(st.just(junk), st.just(TOY_TOOLS[:1]), st.just([])))
        elif how == "parallel":
            line["parallel_tool_calls"] = junk
        elif how == "arguments" and calls:
            fn = draw(st.sampled_from(calls)).get("function")
            if isinstance(fn, dict):
                fn["arguments"] = draw(st.sampled_from(['{"city": "x"}', "{}", "[1]", "{", '{"word": "w"}', junk]))
        elif how == "weight":
            msgs[i]["weight"] = draw(st.sampled_from([0, 1, junk]))
    return json.dumps(line).encode()


@PROPERTY
@given(raw=tool_line())
def test_mutated_tool_lines_read_the_same_on_both_sides(raw: bytes, tmp_path_factory: pytest.TempPathFactory) -> None:
    example, kinds = _gateway(CHAT, raw)
    event(kinds[0] if kinds else "accepted")
    fast = fast_path(raw, CHAT)
    if fast is not None:
        assert example == fast == check_example(decode(raw))
    records, refused = _trainer(CHAT, raw, tmp_path_factory.mktemp("t", numbered=True) / "t.jsonl")
    if kinds:
        assert refused == kinds[0] and fast is None
        return
    assert refused is None and isinstance(example, Chat)
    assert records[1].messages == example.conversations()[0] and records[1].tools == example.tool_schemas()
