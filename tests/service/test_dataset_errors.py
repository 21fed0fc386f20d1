"""Each error class, in its own dataset file, through the real API with a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings
from tests.service.conftest import TENANT_A, Gateway

pytestmark = pytest.mark.service
DATASETS = Path(__file__).parent.parent / "data" / "datasets"
EXPECTED: dict[str, dict[str, Any]] = json.loads((DATASETS / "expected.json").read_text())


@pytest.fixture
def gw_tok(settings: Settings, tiny_catalog: Path) -> Gateway:
    return Gateway(settings.model_copy(update={"default_model": "tiny-chat", "max_seq_len": 256,
                                               "catalog_root": tiny_catalog}))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_error_class_line_and_nothing_usable(gw_tok: Gateway, name: str) -> None:
    want = EXPECTED[name]
    obj = gw_tok.upload(TENANT_A, (DATASETS / name).read_bytes(), filename=name).json()
    assert obj["status"] == "error", obj
    v = obj["validation"]
    assert v["error_counts"] == {want["kind"]: 1}, v["errors"]
    assert v["errors"][0]["line"] == want["line"]
    assert v["stats"]["tokenizer"] == "tiny-chat"
    listed = gw_tok.client.get("/v1/files", headers=gw_tok.auth(TENANT_A)).json()["data"]
    assert [o["status"] for o in listed] == ["error"], "an invalid upload is never 'processed'"


def test_token_statistics_from_the_models_tokenizer(gw_tok: Gateway) -> None:
    obj = gw_tok.upload(TENANT_A, (DATASETS / "warnings_only.jsonl").read_bytes()).json()
    assert obj["status"] == "processed" and obj["model"] == "tiny-chat"
    tok = obj["validation"]["stats"]["tokens"]
    assert 0 < tok["p50"] <= tok["p95"] <= tok["max"] and tok["assistant"] > 0
    assert obj["validation"]["warning_counts"] == {"duplicate_example": 1, "very_short_example": 1}


def test_unknown_model_means_tokens_unchecked(gw_tok: Gateway) -> None:
    r = gw_tok.client.post("/v1/files?model=no-such-model", headers=gw_tok.auth(TENANT_A),
                           data={"purpose": "fine-tune"},
                           files={"file": ("t.jsonl", (DATASETS / "warnings_only.jsonl").read_bytes())})
    assert "tokens_not_checked" in r.json()["validation"]["warning_counts"]


def test_length_bound_is_never_below_the_exact_count(tiny_catalog: Path) -> None:
    import random

    from gateway.datasets.tokencount import HFTokenCounter

    entry = next(iter((tiny_catalog / "tiny-chat").iterdir()))
    counter = HFTokenCounter(entry, "tiny-chat")
    assert counter._overhead is not None, "byte-level BPE must get a bound"
    rng = random.Random(0)
    alphabet = "abc xyz 0123 \n\t.,!?é€🌍中文\u200b\\\"{}" + "".join(chr(c) for c in range(0x400, 0x420))
    convs = []
    for _ in range(300):
        msgs = [{"role": "system", "content": "".join(rng.choices(alphabet, k=rng.randint(0, 30)))}] \
            if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            for role in ("user", "assistant"):
                msgs.append({"role": role, "content": "".join(rng.choices(alphabet, k=rng.randint(0, 200)))})
        convs.append(msgs)
    exact = counter.count(convs)
    for conv, (total, _) in zip(convs, exact, strict=True):
        bound = counter.bound(conv)
        assert bound is not None and bound >= total


def test_too_long_example_caught_outside_the_statistics_sample(tiny_catalog: Path) -> None:
    from gateway.datasets.tokencount import HFTokenCounter
    from gateway.datasets.validation import validate_stream

    entry = next(iter((tiny_catalog / "tiny-chat").iterdir()))
    rows = [json.dumps({"messages": [{"role": "user", "content": f"q {i}"},
                                     {"role": "assistant", "content": f"answer {i}"}]}) for i in range(2100)]
    rows[2049] = json.dumps({"messages": [{"role": "user", "content": "x " * 400},
                                          {"role": "assistant", "content": "ok"}]})   # line 2050
    report = validate_stream([("\n".join(rows) + "\n").encode()],
                             counter=HFTokenCounter(entry, "tiny-chat"), max_seq_len=256)
    assert report["error_counts"] == {"example_too_long": 1}
    assert report["errors"][0]["line"] == 2050
    tok = report["stats"]["tokens"]
    assert tok["exact"] is False and tok["sampled_examples"] < 2100
