"""The ``auto`` hyperparameter rule (gateway.services.autohp): OpenAI's cookbook epochs, OpenAI's legacy
batch size and learning-rate multiplier, turned into our token budget and learning rate."""

from __future__ import annotations

import pytest

from gateway.services import autohp
from gateway.services.autohp import DataFacts, choose
from trainer.contract.spec import HYPERPARAMETER_BOUNDS, HYPERPARAMETER_DEFAULTS, Hyperparameters

SMALL_MODEL = 135_000_000          # SmolLM2-135M
LARGE_MODEL = 70_000_000_000
BASE_LR = HYPERPARAMETER_DEFAULTS["learning_rate"]
SEQ = HYPERPARAMETER_DEFAULTS["max_seq_len"]


def facts(examples: int, tokens_each: int = 40) -> DataFacts:
    return DataFacts(examples=examples, tokens=examples * tokens_each)


@pytest.mark.parametrize(("examples", "epochs"), [
    (1, 25), (4, 25), (5, 20), (10, 10), (30, 4), (33, 4), (34, 3), (100, 3), (8333, 3), (8334, 2),
    (12_500, 2), (25_000, 1), (100_000, 1),
])
def test_epochs_follow_openai_cookbook(examples: int, epochs: int) -> None:
    assert autohp.auto_epochs(examples) == epochs


def test_cookbook_figures() -> None:
    assert (autohp.TARGET_EPOCHS, autohp.MIN_TARGET_EXAMPLES, autohp.MAX_TARGET_EXAMPLES,
            autohp.MIN_DEFAULT_EPOCHS, autohp.MAX_DEFAULT_EPOCHS) == (3, 100, 25_000, 1, 25)


@pytest.mark.parametrize(("examples", "batch"), [(10, 1), (100, 1), (1000, 2), (10_000, 20), (100_000, 200),
                                                 (1_000_000, 256)])
def test_batch_is_two_per_mille_capped_at_256(examples: int, batch: int) -> None:
    assert autohp.auto_batch_examples(examples) == batch


def test_100_and_100000_examples_get_different_values() -> None:
    small = choose({}, facts(100), parameters=SMALL_MODEL)
    large = choose({}, facts(100_000), parameters=SMALL_MODEL)
    assert small.values == {"epochs": 3, "batch_size_tokens": SEQ, "learning_rate": BASE_LR}
    assert small.batch_size == 51                  # 2048 tokens of 40-token examples
    assert large.values == {"epochs": 1, "batch_size_tokens": 8192, "learning_rate": 2 * BASE_LR}
    assert large.batch_size == 205                 # 200 examples of 40 tokens, rounded to 8192 tokens


def test_batch_tokens_power_of_two_at_least_a_row_within_bounds() -> None:
    assert autohp.batch_tokens(200, 40.0, 2048) == (8192, None)
    assert autohp.batch_tokens(1, 40.0, 2048) == (2048, None)           # one example must fit a step
    assert autohp.batch_tokens(1, 40.0, 1000) == (1000, None)           # a row that is no power of two
    high = HYPERPARAMETER_BOUNDS["batch_size_tokens"].high
    assert autohp.batch_tokens(256, 100_000.0, 2048) == (high, None)
    assert autohp.batch_tokens(1, 40.0, 2048, gpus=4) == (8192, 2048)   # a row per rank, and what it was


def test_multiplier_by_final_batch_and_model_size() -> None:
    assert [autohp.multiplier(b) for b in (1, 7, 8, 63, 64, 256)] == [0.05, 0.05, 0.1, 0.1, 0.2, 0.2]
    assert autohp.learning_rate(1, SMALL_MODEL) == pytest.approx(BASE_LR / 2)
    assert autohp.learning_rate(20, None) == pytest.approx(BASE_LR)
    assert autohp.learning_rate(100, SMALL_MODEL) == pytest.approx(2 * BASE_LR)
    assert autohp.learning_rate(100, LARGE_MODEL) == pytest.approx(BASE_LR)    # halved from 20B on


def test_small_and_large_model() -> None:
    small = choose({}, facts(100_000), parameters=SMALL_MODEL)
    large = choose({}, facts(100_000), parameters=LARGE_MODEL)
    assert large.values["learning_rate"] == pytest.approx(small.values["learning_rate"] / 2)
    assert {k: v for k, v in large.values.items() if k != "learning_rate"} == \
        {k: v for k, v in small.values.items() if k != "learning_rate"}


def test_long_examples_make_small_batches_and_low_rates() -> None:
    got = choose({}, facts(1000, tokens_each=600), parameters=SMALL_MODEL)
    assert got.values["batch_size_tokens"] == SEQ and got.batch_size == 3
    assert got.values["learning_rate"] == pytest.approx(BASE_LR / 2)


def test_a_step_never_counts_more_examples_than_the_file() -> None:
    got = choose({}, facts(10), parameters=SMALL_MODEL)
    assert got.batch_size == 10 and got.values["learning_rate"] == pytest.approx(BASE_LR)


def test_user_values_win() -> None:
    given = {"epochs": 7, "batch_size_tokens": 4096, "learning_rate": 1e-3}
    got = choose(given, facts(100_000), parameters=SMALL_MODEL)
    assert got.values == {} and got.record()["chosen"] == []
    assert got.batch_size == 102                        # what 4096 tokens hold of this file, shown as OpenAI's
    only_lr = choose({"learning_rate": 1e-3}, facts(100), parameters=SMALL_MODEL)
    assert set(only_lr.values) == {"epochs", "batch_size_tokens"}


def test_given_batch_sets_the_rate() -> None:
    assert choose({"batch_size_tokens": 65536}, facts(50), parameters=SMALL_MODEL).values["learning_rate"] \
        == pytest.approx(BASE_LR)         # 50 examples (the whole file) per step: the middle rate
    assert choose({"batch_size_tokens": 65536}, facts(5000), parameters=SMALL_MODEL).values["learning_rate"] \
        == pytest.approx(2 * BASE_LR)


def test_max_seq_len_given_is_the_floor() -> None:
    got = choose({"max_seq_len": 256}, facts(100), parameters=SMALL_MODEL)
    assert got.values["batch_size_tokens"] == 256


def test_dpo_step_holds_a_whole_pair() -> None:
    got = choose({}, facts(100, tokens_each=400), parameters=SMALL_MODEL, method="dpo")
    assert got.values["batch_size_tokens"] >= 2 * SEQ
    got = choose({"max_seq_len": 512}, facts(50_000, tokens_each=30), parameters=SMALL_MODEL, method="dpo")
    assert got.values["batch_size_tokens"] == 4096 and got.values["batch_size_tokens"] >= 2 * 512


def test_epochs_capped_by_the_caller() -> None:
    assert choose({}, facts(10), parameters=None, max_epochs=4).values["epochs"] == 4
    assert choose({}, facts(10), parameters=None, max_epochs=0).values["epochs"] == 1
    assert choose({"epochs": 9}, facts(10), parameters=None, max_epochs=4).values == \
        choose({"epochs": 9}, facts(10), parameters=None).values


@pytest.mark.parametrize("examples", [1, 10, 100, 1000, 100_000, 10_000_000])
@pytest.mark.parametrize("tokens_each", [1, 40, 2048, 100_000])
@pytest.mark.parametrize("method", ["supervised", "dpo"])
def test_chosen_values_are_valid_hyperparameters(examples: int, tokens_each: int, method: str) -> None:
    got = choose({}, facts(examples, tokens_each), parameters=LARGE_MODEL, method=method)
    hp = Hyperparameters.model_validate(got.values)          # within the contract's bounds
    assert hp.batch_size_tokens >= (2 if method == "dpo" else 1) * hp.max_seq_len
    assert 1 <= got.batch_size


def test_facts_from_the_validation_report() -> None:
    report = {"stats": {"examples": 100, "tokens": {"total": 4000, "p50": 40}}}
    assert DataFacts.from_validation(report, 123_456) == DataFacts(100, 4000)
    no_tokenizer = {"stats": {"examples": 100, "tokens": None}}
    assert DataFacts.from_validation(no_tokenizer, 16_000) == DataFacts(100, 4000)    # 4 bytes a token
    assert DataFacts.from_validation(None, 0) == DataFacts(1, 1)
