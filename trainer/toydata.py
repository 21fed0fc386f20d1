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
