"""Deterministic toy chat data for the tiny model (tests, bench, demos)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from trainer.catalog import _WORDS


def toy_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Return ``n`` chat examples of a learnable task (repeat / reverse a few words)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 5))]
        task = rng.choice(["repeat", "reverse"])
        answer = words if task == "repeat" else words[::-1]
        messages: list[dict[str, Any]] = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": "You follow instructions."})
        if i % 4 == 0:  # a turn that must not be learned (weight 0)
            messages += [
                {"role": "user", "content": "count " + str(rng.randint(0, 99))},
                {"role": "assistant", "content": "ok", "weight": 0},
            ]
        messages += [
            {"role": "user", "content": f"{task}: {' '.join(words)}"},
            {"role": "assistant", "content": " ".join(answer)},
        ]
        out.append({"messages": messages})
    return out


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows as JSON lines; return the path."""
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def toy_preferences(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Return ``n`` preference pairs (OpenAI's DPO format) of the chat task above: the preferred output
    does what the prompt asks (repeat / reverse a few words); the non-preferred one does the other and
    ends curtly (" - no."), a habit a small model unlearns within a few steps (never identical)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 5))]
        while words == words[::-1]:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 5))]
        task = rng.choice(["repeat", "reverse"])
        right, wrong = (words, words[::-1]) if task == "repeat" else (words[::-1], words)
        messages: list[dict[str, Any]] = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": "You follow instructions."})
        if i % 4 == 0:  # a multi-turn prompt
            messages += [{"role": "user", "content": "count " + str(rng.randint(0, 99))},
                         {"role": "assistant", "content": "ok"}]
        messages.append({"role": "user", "content": f"{task}: {' '.join(words)}"})
        out.append({"input": {"messages": messages},
                    "preferred_output": [{"role": "assistant", "content": " ".join(right)}],
                    "non_preferred_output": [{"role": "assistant", "content": " ".join(wrong) + " - no."}]})
    return out


# --------------------------------------------------------------------- tool calling

TOY_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "lookup_word", "description": "A word's entry in the dictionary",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}},
]
"""The functions every toy tool-calling line declares."""


def toy_tool_prompt(rng: random.Random) -> tuple[str, str, dict[str, str]]:
    """A user request, the function that serves it and its arguments (words from the tiny
    model's vocabulary, so a held-out prompt differs from the training ones in its words only)."""
    word = rng.choice(_WORDS)
    if rng.random() < 0.5:
        return f"what is the weather in {word} today", "get_weather", {"city": word}
    return f"please look up the word {word}", "lookup_word", {"word": word}


def toy_tool_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` OpenAI tool-calling chat lines of a learnable task: the user asks for weather or a word,
    the assistant calls the function that serves it (content null), the tool answers (not trained)
    and the assistant reports the answer; every third line also has a plain turn first."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, function, args = toy_tool_prompt(rng)
        value = rng.choice(_WORDS)
        messages: list[dict[str, Any]] = []
        if i % 3 == 0:
            words = [rng.choice(_WORDS) for _ in range(3)]
            messages += [{"role": "user", "content": f"repeat: {' '.join(words)}"},
                         {"role": "assistant", "content": " ".join(words)}]
        call_id = f"call_{i}"
        messages += [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": function, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"result": value})},
            {"role": "assistant", "content": f"the answer is {value}"},
        ]
        out.append({"messages": messages, "tools": TOY_TOOLS, "parallel_tool_calls": False})
    return out


def parse_tool_call(reply: str, tools: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The call in a generated reply in the Hermes/Qwen2.5 form the tool-capable ChatML template
    renders (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), when it names a
    declared function and its arguments are a JSON object holding the schema's required keys;
    else None. As vLLM's Hermes parser does, the JSON object after ``<tool_call>`` is the call
    (a missing or misspelt closing tag does not void it)."""
    start = reply.find("<tool_call>")
    if start < 0:
        return None
    try:
        call, _ = json.JSONDecoder().raw_decode(reply[start + len("<tool_call>"):].lstrip())
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
        return None
    declared = {t["function"]["name"]: t["function"] for t in tools}
    function = declared.get(call.get("name"))  # type: ignore[arg-type]
    if function is None:
        return None
    required = function.get("parameters", {}).get("required", [])
    return call if all(k in call["arguments"] for k in required) else None
