"""Session fixtures for trainer tests: one tiny model per session, toy data, a reference run."""

from __future__ import annotations

import time
from typing import Any

import pytest
from trainer_testlib import CANARY, Reference, Tiny, ToyData, make_spec, run_trainer, write_spec


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """The tiny Llama, built once per session and registered in a temp catalog."""
    from trainer.catalog import add, make_tiny

    base = tmp_path_factory.mktemp("tiny")
    built = make_tiny(base / "build")
    entry = add(built, "tiny", base / "models")
    return Tiny(base / "models", entry.name, entry.digest, base / "models" / entry.path)


@pytest.fixture(scope="session")
def toy(tmp_path_factory: pytest.TempPathFactory) -> ToyData:
    """Toy train/validation files; the train file carries a canary string."""
    from trainer.data import sha256_file
    from trainer.toydata import toy_conversations, write_jsonl

    base = tmp_path_factory.mktemp("data")
    rows = toy_conversations(240, seed=1)
    for i in (3, 50, 101):  # plant the canary in user and assistant text
        rows[i]["messages"][-2]["content"] += f" {CANARY}"
        rows[i]["messages"][-1]["content"] += f" {CANARY}"
    train = write_jsonl(base / "train.jsonl", rows)
    val = write_jsonl(base / "val.jsonl", toy_conversations(40, seed=2))
    return ToyData(train, sha256_file(train), val, sha256_file(val))


@pytest.fixture(scope="session")
def measured_step(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The memory probes of test_memory_estimate_measured (its ``Probes``), once per session."""
    from test_memory_estimate_measured import Probes  # the test module, collected already

    return Probes(tiny, tmp_path_factory)


@pytest.fixture(autouse=True)
def _smollm2_probes_early(request: pytest.FixtureRequest) -> None:
    """With the first train-tier test, start SmolLM2's memory probes when their test is in this run:
    each is one thread measuring its own memory, so they run on the core the one-thread tests before
    theirs leave idle (about 2 minutes less for the tier on 2 cores), instead of after them."""
    if "train" not in request.keywords or not any(
            item.path.name == "test_memory_estimate_measured.py" for item in request.session.items):
        return
    from test_memory_estimate_measured import _smollm2

    if _smollm2() is not None:
        request.getfixturevalue("measured_step").start("smollm2")


@pytest.fixture(scope="session")
def reference(tiny: Tiny, toy: ToyData, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """One uninterrupted run, compared against by resume/signal tests."""
    base = tmp_path_factory.mktemp("reference")
    spec = make_spec(tiny, toy, base / "job")
    log = base / "trainer.log"
    t0 = time.monotonic()
    rc = run_trainer(write_spec(spec, base / "spec.json"), log)
    seconds = time.monotonic() - t0
    return Reference(spec, base / "job", base / "job" / "attempts" / "0" / "staging", log, rc, seconds)
