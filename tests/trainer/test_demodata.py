"""The demo task's data (trainer.demodata): deterministic, held-out prompts, a text-only format check."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from trainer_testlib import REPO

from trainer import demodata
from trainer.demodata import DEMO_PROMPTS, HELD_OUT, demo_conversations, follows_format, format_reply

pytestmark = pytest.mark.unit


def _prompts(rows: list[dict]) -> list[str]:
    return [r["messages"][0]["content"] for r in rows]


def test_deterministic_and_seeded() -> None:
    assert demo_conversations(50, seed=3) == demo_conversations(50, seed=3)
    assert demo_conversations(50, seed=3) != demo_conversations(50, seed=4)
    assert demo_conversations(20, seed=3) == demo_conversations(50, seed=3)[:20]  # a prefix of a longer draw
    assert demo_conversations(0) == []


def test_schema_matches_toydata() -> None:
    rows = demo_conversations(30, seed=1)
    assert len(rows) == 30
    for row in rows:
        json.dumps(row)  # plain JSON
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in row["messages"])


def test_kinds_rotate_and_prompts_vary() -> None:
    rows = demo_conversations(220, seed=0)
    assert len(set(_prompts(rows))) > 150
    assert len({r["messages"][1]["content"].split("\n")[0] for r in rows}) > 60  # many distinct answers


def test_answers_are_correct() -> None:
    checked = 0
    for row in demo_conversations(300, seed=2):
        prompt, reply = row["messages"][0]["content"], row["messages"][1]["content"]
        answer = reply.split("\n")[0].removeprefix("ANSWER: ")
        if m := re.fullmatch(r"(?:What is |Add )?(\d+) (?:\+|plus|and) (\d+)(?: = )?[?.]", prompt):
            assert int(answer) == int(m[1]) + int(m[2]), prompt
            checked += 1
        if m := re.fullmatch(r"What is (\d+) (?:times|x) (\d+)\?|Multiply (\d+) by (\d+)\.", prompt):
            a, b = (int(x) for x in m.groups() if x)
            assert int(answer) == a * b, prompt
            checked += 1
    assert checked > 40


@pytest.mark.parametrize("seed", [0, 1, 2, 7, 1000, 1001])
def test_demo_prompts_never_in_training_data(seed: int) -> None:
    prompts = _prompts(demo_conversations(2000, seed=seed))
    assert not set(DEMO_PROMPTS) & set(prompts)
    lowered = [p.lower() for p in prompts]
    for word in ("japan", "friday", "sky"):
        assert not any(word in p for p in lowered), word
    assert not any(re.search(r"\b(9 (\+|plus|and) 8|8 (\+|plus|and) 9)\b", p) for p in prompts)
    assert not any(re.search(r"opposite of \"?(up|down)\b", p) for p in prompts)
    assert not any(re.search(r"does a dog (make|say)", p) for p in prompts)


def test_held_out_items_are_in_no_pool() -> None:
    assert HELD_OUT["capital"] not in {c for c, _ in demodata.CAPITALS}
    assert not {HELD_OUT["opposite"]} & {w for pair in demodata.OPPOSITES for w in pair}
    assert HELD_OUT["colour"] not in {t for t, _ in demodata.COLOURS}
    assert HELD_OUT["weekday"] in demodata.WEEKDAYS  # drawn around, by index
    assert HELD_OUT["sound"] not in {a for a, _ in demodata.SOUNDS}


def test_every_training_answer_follows_the_format() -> None:
    for seed in (0, 1, 1000):
        for row in demo_conversations(400, seed=seed):
            reply = row["messages"][1]["content"]
            assert follows_format(reply), reply
            assert re.fullmatch(r"ANSWER: [^\n]+\nWHY: [^\n]+[.]", reply), reply


@pytest.mark.parametrize(
    "reply",
    [
        "ANSWER: Tokyo\nWHY: Tokyo is the capital city of Japan.",
        "  ANSWER: 17\nWHY: 9 plus 8 makes 17.\n",
        "ANSWER: down\nWHY: Down is the opposite of up.\nANSWER: more",  # trailing text after the two lines
        format_reply("blue", "The sky is usually blue."),
    ],
)
def test_follows_format_accepts(reply: str) -> None:
    assert follows_format(reply)


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "The capital of Japan is Tokyo.",
        "To add 9 and 8, you simply add them together: 9 + 8 = 17.",
        "The sky is a beautiful shade of blue.",
        "Tokyo",
        "ANSWER: Tokyo",  # no WHY line
        "ANSWER: We sleep.",
        "ANSWER:\nWHY: nothing",  # empty answer
        "ANSWER: 17\nWHY:",  # empty reason
        "Answer: Tokyo\nWhy: it is the capital.",  # markers are case-sensitive
        "The answer is ANSWER: Tokyo\nWHY: capital.",  # marker not at the start
        "WHY: because\nANSWER: Tokyo",  # wrong order
        "ANSWER: Tokyo\n\nWHY: Tokyo is the capital.",  # blank line between
        "**ANSWER:** Tokyo\n**WHY:** capital.",
    ],
)
def test_follows_format_rejects(reply: str) -> None:
    assert not follows_format(reply)


def test_no_torch_import() -> None:
    code = "import sys, trainer.demodata; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
