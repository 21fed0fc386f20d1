"""Deterministic demo chat data for SmolLM2: a fixed answer format the base model never uses.

The task taught by ``finetune demo``: every reply is exactly two lines,

    ANSWER: <short answer>
    WHY: <one sentence>

for simple questions generated from templates with correct answers (capitals,
arithmetic, opposites, colours, animal sounds, baby animals, plurals, weekdays,
legs). SmolLM2-135M-Instruct answers such questions in free prose ("The capital
of Japan is Tokyo."), so the change is visible at a glance and decidable from
the text alone: :func:`follows_format`.

:data:`DEMO_PROMPTS` are held out: their items (:data:`HELD_OUT`: Japan, 9 + 8,
"up", the sky, the day after Friday, a dog's sound) are never asked about in
training, and :func:`demo_conversations` also redraws any prompt equal to one
of them, so none is ever trained on, for any ``n`` or ``seed``.

Measured here (2 CPU cores, OMP_NUM_THREADS=2): greedy replies of the base
model follow the format on 0 of the 6 prompts; after QLoRA on
``demo_conversations(80, seed=0)`` (epochs 2, learning_rate 2e-3,
batch_size_tokens 512, max_seq_len 128, warmup_steps 3, LoRA r 16 / alpha 32:
20 steps, ~110 s for the whole trainer run) on 6 of 6, in every one of
several runs with other seeds; eval loss ~3.2 -> ~0.16, token accuracy
~0.47 -> ~0.96 on ``demo_conversations(40, seed=1000)``.
Pure Python (no torch), like ``trainer.toydata``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

# ------------------------------------------------------------------ facts (all correct)

# fmt: off
CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"),
    ("Greece", "Athens"), ("Russia", "Moscow"), ("China", "Beijing"), ("India", "New Delhi"),
    ("Mexico", "Mexico City"), ("Ireland", "Dublin"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Sweden", "Stockholm"), ("Cuba", "Havana"), ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"),
    ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Hungary", "Budapest"), ("England", "London"),
    ("South Korea", "Seoul"),
]
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("open", "closed"), ("old", "young"), ("tall", "short"), ("full", "empty"), ("hard", "soft"),
    ("wet", "dry"), ("rich", "poor"), ("loud", "quiet"), ("strong", "weak"), ("high", "low"),
    ("clean", "dirty"), ("near", "far"), ("day", "night"), ("win", "lose"), ("push", "pull"),
    ("thick", "thin"), ("heavy", "light"), ("in", "out"), ("first", "last"),
]
COLOURS = [
    ("grass", "green"), ("snow", "white"), ("coal", "black"), ("a ripe tomato", "red"), ("a lemon", "yellow"),
    ("an orange", "orange"), ("a carrot", "orange"), ("milk", "white"), ("a strawberry", "red"),
    ("a lime", "green"), ("chocolate", "brown"), ("a crow", "black"), ("a pumpkin", "orange"),
    ("a cucumber", "green"), ("a polar bear", "white"), ("blood", "red"),
]
SOUNDS = [
    ("cow", "moo"), ("cat", "meow"), ("sheep", "baa"), ("pig", "oink"), ("lion", "roar"), ("owl", "hoot"),
    ("snake", "hiss"), ("horse", "neigh"), ("mouse", "squeak"), ("bee", "buzz"), ("frog", "croak"),
    ("duck", "quack"), ("donkey", "hee-haw"), ("rooster", "cock-a-doodle-doo"),
]
YOUNG = [
    ("cat", "kitten"), ("dog", "puppy"), ("cow", "calf"), ("sheep", "lamb"), ("horse", "foal"),
    ("frog", "tadpole"), ("goat", "kid"), ("bear", "cub"), ("kangaroo", "joey"), ("swan", "cygnet"),
    ("deer", "fawn"), ("goose", "gosling"), ("hen", "chick"), ("pig", "piglet"),
]
PLURALS = [
    ("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"), ("man", "men"),
    ("woman", "women"), ("goose", "geese"), ("person", "people"), ("leaf", "leaves"), ("knife", "knives"),
    ("box", "boxes"), ("city", "cities"), ("wolf", "wolves"), ("bus", "buses"), ("ox", "oxen"),
]
LEGS = [
    ("spider", 8), ("dog", 4), ("chicken", 2), ("ant", 6), ("cat", 4), ("octopus", 8), ("bee", 6),
    ("horse", 4), ("duck", 2), ("beetle", 6), ("cow", 4), ("penguin", 2),
]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
# fmt: on

# what DEMO_PROMPTS ask about, by kind: never drawn for training
HELD_OUT: dict[str, Any] = {
    "capital": "Japan",
    "add": (9, 8),
    "opposite": "up",
    "colour": "the sky",
    "weekday": "Friday",
    "sound": "dog",
}

DEMO_PROMPTS: list[str] = [
    "What is the capital of Japan?",
    "What is 9 + 8?",
    "What is the opposite of up?",
    "What colour is the sky?",
    "What day comes after Friday?",
    "What sound does a dog make?",
]
"""Held-out user prompts for the before/after comparison (never in the training data)."""

_QA = tuple[str, str, str]  # (user prompt, answer, why)


def _capital(rng: random.Random) -> _QA:
    country, city = rng.choice(CAPITALS)
    ask = rng.choice(
        [
            "What is the capital of {c}?",
            "Which city is the capital of {c}?",
            "Tell me the capital of {c}.",
            "What's the capital city of {c}?",
            "capital of {c}?",
        ]
    )
    return ask.format(c=country), city, f"{city} is the capital city of {country}."


def _add(rng: random.Random) -> _QA:
    while True:
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        if HELD_OUT["add"] not in ((a, b), (b, a)):
            break
    ask = rng.choice(["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "{a} + {b} = ?"])
    return ask.format(a=a, b=b), str(a + b), f"{a} plus {b} makes {a + b}."


def _subtract(rng: random.Random) -> _QA:
    a = rng.randint(5, 30)
    b = rng.randint(1, a - 1)
    ask = rng.choice(["What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}."])
    return ask.format(a=a, b=b), str(a - b), f"Taking {b} away from {a} leaves {a - b}."


def _multiply(rng: random.Random) -> _QA:
    a, b = rng.randint(2, 10), rng.randint(2, 10)
    ask = rng.choice(["What is {a} times {b}?", "What is {a} x {b}?", "Multiply {a} by {b}."])
    return ask.format(a=a, b=b), str(a * b), f"{a} groups of {b} make {a * b}."


def _opposite(rng: random.Random) -> _QA:
    word, other = rng.choice(OPPOSITES)
    if rng.random() < 0.5:
        word, other = other, word
    ask = rng.choice(["What is the opposite of {w}?", 'What\'s the opposite of "{w}"?', "Give me the opposite of {w}."])
    return ask.format(w=word), other, f"{other.capitalize()} is the opposite of {word}."


def _colour(rng: random.Random) -> _QA:
    thing, colour = rng.choice(COLOURS)
    ask = rng.choice(["What colour is {t}?", "What color is {t}?", "Which colour is {t}?"])
    return ask.format(t=thing), colour, f"{thing[0].upper() + thing[1:]} is usually {colour}."


def _sound(rng: random.Random) -> _QA:
    animal, sound = rng.choice(SOUNDS)
    ask = rng.choice(["What sound does a {a} make?", "What noise does a {a} make?", "What does a {a} say?"])
    return ask.format(a=animal), sound, f"A {animal} says {sound}."


def _young(rng: random.Random) -> _QA:
    animal, baby = rng.choice(YOUNG)
    ask = rng.choice(["What is a baby {a} called?", "What do you call a young {a}?", "What is a baby {a}?"])
    return ask.format(a=animal), baby, f"A young {animal} is called a {baby}."


def _plural(rng: random.Random) -> _QA:
    word, plural = rng.choice(PLURALS)
    ask = rng.choice(["What is the plural of {w}?", 'What\'s the plural of "{w}"?', "Plural of {w}?"])
    return ask.format(w=word), plural, f"One {word}, two {plural}."


def _legs(rng: random.Random) -> _QA:
    animal, legs = rng.choice(LEGS)
    ask = rng.choice(["How many legs does a {a} have?", "How many legs has a {a} got?", "Number of legs of a {a}?"])
    return ask.format(a=animal), str(legs), f"A {animal} walks on {legs} legs."


def _weekday(rng: random.Random) -> _QA:
    i = rng.choice([i for i, day in enumerate(WEEKDAYS) if day != HELD_OUT["weekday"]])
    day, nxt = WEEKDAYS[i], WEEKDAYS[(i + 1) % 7]
    ask = rng.choice(["What day comes after {d}?", "Which day follows {d}?", "What is the day after {d}?"])
    return ask.format(d=day), nxt, f"The week goes {day}, then {nxt}."


_KINDS: list[Callable[[random.Random], _QA]] = [
    _capital,
    _add,
    _subtract,
    _multiply,
    _opposite,
    _colour,
    _sound,
    _young,
    _plural,
    _legs,
    _weekday,
]


def format_reply(answer: str, why: str) -> str:
    """The taught reply: ``ANSWER: <answer>`` then ``WHY: <one sentence>``."""
    return f"ANSWER: {answer}\nWHY: {why}"


def demo_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Return ``n`` chat examples (``{"messages": [user, assistant]}``) teaching the format.

    Deterministic in ``(n, seed)``; question kinds rotate so every kind appears
    once ``n >= len(_KINDS)``; no user prompt is one of :data:`DEMO_PROMPTS`.
    """
    rng = random.Random(seed)
    held_out = set(DEMO_PROMPTS)
    out = []
    for i in range(n):
        prompt, answer, why = _KINDS[i % len(_KINDS)](rng)
        while prompt in held_out:
            prompt, answer, why = _KINDS[i % len(_KINDS)](rng)
        out.append(
            {
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": format_reply(answer, why)},
                ]
            }
        )
    return out


_ANSWER = re.compile(r"ANSWER: \S[^\n]*")
_WHY = re.compile(r"WHY: \S[^\n]*")


def follows_format(reply: str) -> bool:
    """Whether ``reply`` follows the taught format: first line ``ANSWER: …``, second ``WHY: …``.

    Leading/trailing whitespace is ignored; the marker words are case-sensitive.
    """
    lines = reply.strip().splitlines()
    return len(lines) >= 2 and bool(_ANSWER.fullmatch(lines[0].strip())) and bool(_WHY.fullmatch(lines[1].strip()))


# ------------------------------------------------------------------ the demo's job (measured)
# On 2 CPU cores (OMP_NUM_THREADS=2): 20 optimizer steps of ~460 tokens, ~110 s for the whole
# trainer run (load, eval, train, eval, save), peak RSS 1.9 GB; eval loss 3.18 -> 0.16, token
# accuracy 0.47 -> 0.96; the format on 6/6 held-out prompts in 14 runs (base model: 0/6).
MODEL = "smollm2-135m-instruct"
EXAMPLES = 80
TRAIN_SEED = 0
VALIDATION_EXAMPLES = 40
VALIDATION_SEED = 1000
HYPERPARAMETERS: dict[str, Any] = {"n_epochs": 2, "learning_rate_multiplier": 10, "batch_size_tokens": 512,
                                   "max_seq_len": 128, "warmup_steps": 3, "checkpoint_every_steps": 10}
MAX_NEW_TOKENS = 40
