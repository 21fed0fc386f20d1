"""``"auto"`` hyperparameters: epochs, step size and learning rate chosen from the training data and
the base model's size, as OpenAI and Together choose theirs. Pure: no database, no file, no model.

The rule, with its sources:

- **Epochs** (OpenAI's cookbook, "Data preparation and analysis for chat model fine-tuning",
  https://cookbook.openai.com/examples/chat_finetuning_data_prep, its "Training cost" cell):
  ``TARGET_EPOCHS = 3``, ``MIN_TARGET_EXAMPLES = 100``, ``MAX_TARGET_EXAMPLES = 25000``,
  ``MIN_DEFAULT_EPOCHS = 1``, ``MAX_DEFAULT_EPOCHS = 25``: with ``n`` examples, 3 epochs, unless
  ``3 n < 100`` (then ``min(25, ceil(100 / n))``: a small file is seen about 100 times in all) or
  ``3 n > 25000`` (then ``max(1, floor(25000 / n))``: a large one about 25,000 examples' worth).
  The caller may cap it (``max_epochs``: what the site's limits admit, so that ``auto`` never
  makes a job admission refuses).
- **Batch size** (OpenAI's legacy fine-tunes API reference, ``batch_size``: "By default, the batch
  size will be dynamically configured to be ~0.2% of the number of examples in the training set,
  capped at 256"): ``clamp(round(0.002 n), 1, 256)`` examples. We batch by tokens, so that many
  examples of the file's mean length, rounded to a power of two, is ``batch_size_tokens``; at
  least ``max_seq_len`` (a step holds a whole example; DPO: ``2 * max_seq_len``, a whole pair),
  within the contract's range, and widened to a row per rank for a gang (as
  ``jobmemory.widen_for_ranks`` widens the default).
- **Learning rate** (the same reference, ``learning_rate_multiplier``: "By default, the learning
  rate multiplier is the 0.05, 0.1, or 0.2 depending on final batch_size (larger learning rates
  tend to perform better with larger batch sizes)"). The reference gives no thresholds: we split
  its batch range (1 to 256, 2^0 to 2^8) in log-thirds at 8 and 64 examples, counted as the final
  step's examples-equivalent (``batch_size_tokens`` / mean tokens per example, at most the file's
  examples). Our base learning
  rate (the contract's default, a LoRA rate) is the middle value's: the rate is
  ``base * multiplier / 0.1``, so 0.5x, 1x or 2x the base. Model size, gently: halved for a base of
  20 billion parameters or more, after QLoRA (Dettmers et al. 2023, arXiv:2305.14314, appendix B:
  2e-4 for 7B and 13B, 1e-4 for 33B and 65B; 20B is between); never raised for small models.

Values the request gives always win (each is left as it is); only the ones it leaves out are chosen.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.contract.spec import HYPERPARAMETER_BOUNDS, HYPERPARAMETER_DEFAULTS

TARGET_EPOCHS = 3               # OpenAI's cookbook figures (module doc)
MIN_TARGET_EXAMPLES = 100
MAX_TARGET_EXAMPLES = 25_000
MIN_DEFAULT_EPOCHS = 1
MAX_DEFAULT_EPOCHS = 25
BATCH_FRACTION = 0.002          # OpenAI's legacy API: ~0.2 % of the examples ...
MAX_BATCH_EXAMPLES = 256        # ... capped at 256
MULTIPLIERS = ((8, 0.05), (64, 0.1))   # (examples per step below which, multiplier); 0.2 above
LARGEST_MULTIPLIER = 0.2
MIDDLE_MULTIPLIER = 0.1         # the multiplier our base learning rate stands for
LARGE_MODEL_PARAMETERS = 20_000_000_000
LARGE_MODEL_FACTOR = 0.5        # QLoRA: 1e-4 instead of 2e-4 from 33B on
CHOSEN = ("epochs", "batch_size_tokens", "learning_rate")
"""What ``auto`` chooses (our names): OpenAI's ``n_epochs``, ``batch_size``, ``learning_rate_multiplier``."""


@dataclass(frozen=True)
class DataFacts:
    """What the rule needs of a training file: its examples (pairs for DPO) and their tokens."""

    examples: int
    tokens: int              # all of them (a DPO pair counts both sequences)

    @property
    def mean_tokens(self) -> float:
        """Tokens per example (at least 1)."""
        return max(1.0, self.tokens / max(1, self.examples))

    @classmethod
    def from_validation(cls, validation: Mapping[str, Any] | None, size_bytes: int) -> DataFacts:
        """The facts the upload validator recorded (``DataFile.validation``); without token counts
        (no tokenizer at upload) the tokens are estimated at 4 bytes each, as the time estimate does."""
        stats = (validation or {}).get("stats") or {}
        examples = stats.get("examples")
        total = (stats.get("tokens") or {}).get("total")
        return cls(examples=examples if isinstance(examples, int) and examples > 0 else 1,
                   tokens=total if isinstance(total, int) and total > 0 else max(1, size_bytes // 4))


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: ``values`` (our names; only those the request left out),
    ``batch_size`` (the final step's examples-equivalent, OpenAI's ``batch_size``) and
    ``widened_from`` (the chosen ``batch_size_tokens`` before a gang widened it, else None)."""

    values: dict[str, Any]
    batch_size: int
    widened_from: int | None = None

    def record(self) -> dict[str, Any]:
        """What the job row keeps of the choice (``jobspec.AUTO``): which values were chosen and the
        examples-equivalent batch size the job object shows."""
        return {"chosen": sorted(self.values), "batch_size": self.batch_size,
                **({"widened_from": self.widened_from} if self.widened_from is not None else {})}


def auto_epochs(examples: int) -> int:
    """OpenAI's cookbook rule: the epochs for ``examples`` training examples (1 to 25)."""
    n = max(1, examples)
    if n * TARGET_EPOCHS < MIN_TARGET_EXAMPLES:
        return min(MAX_DEFAULT_EPOCHS, math.ceil(MIN_TARGET_EXAMPLES / n))
    if n * TARGET_EPOCHS > MAX_TARGET_EXAMPLES:
        return max(MIN_DEFAULT_EPOCHS, MAX_TARGET_EXAMPLES // n)
    return TARGET_EPOCHS


def auto_batch_examples(examples: int) -> int:
    """OpenAI's legacy default: ~0.2 % of ``examples`` per batch, at least 1, at most 256."""
    return min(MAX_BATCH_EXAMPLES, max(1, round(BATCH_FRACTION * examples)))


def _power_of_two(x: float) -> int:
    """The power of two nearest ``x`` on a log scale (at least 1)."""
    return 1 << max(0, round(math.log2(max(1.0, x))))


def batch_tokens(examples_per_step: int, mean_tokens: float, row: int, gpus: int = 1) -> tuple[int, int | None]:
    """``(batch_size_tokens, widened_from)``: ``examples_per_step`` examples of ``mean_tokens``, a
    power of two, at least ``row`` (``max_seq_len``; DPO twice that) and within the contract's range;
    then at least a row per rank of ``gpus`` (``widened_from``: the value before, else None)."""
    bounds = HYPERPARAMETER_BOUNDS["batch_size_tokens"]
    tokens = max(_power_of_two(examples_per_step * mean_tokens), row)
    assert bounds.low is not None and bounds.high is not None    # the contract bounds it both ways
    tokens = min(max(tokens, int(bounds.low)), int(bounds.high))
    if gpus > 1 and tokens < gpus * row:
        return gpus * row, tokens
    return tokens, None


def multiplier(batch_examples: float) -> float:
    """OpenAI's legacy multiplier (0.05, 0.1 or 0.2) for a final step of ``batch_examples`` examples."""
    return next((m for below, m in MULTIPLIERS if batch_examples < below), LARGEST_MULTIPLIER)


def learning_rate(batch_examples: float, parameters: int | None) -> float:
    """Our base learning rate scaled by :func:`multiplier` (relative to the middle one) and halved for
    a base of :data:`LARGE_MODEL_PARAMETERS` or more (``parameters`` None: size unknown, not scaled);
    within the contract's range."""
    rate = HYPERPARAMETER_DEFAULTS["learning_rate"] * multiplier(batch_examples) / MIDDLE_MULTIPLIER
    if parameters is not None and parameters >= LARGE_MODEL_PARAMETERS:
        rate *= LARGE_MODEL_FACTOR
    bounds = HYPERPARAMETER_BOUNDS["learning_rate"]
    return min(rate, float(bounds.high)) if bounds.high is not None else rate


def choose(given: Mapping[str, Any], data: DataFacts, *, parameters: int | None, method: str = "supervised",
           gpus: int = 1, max_epochs: int | None = None) -> Choice:
    """The ``auto`` values for a request whose hyperparameters (our names) are ``given``: those of
    :data:`CHOSEN` it leaves out, from ``data`` and the base's ``parameters`` (see the module doc).
    ``max_epochs``: a cap on the chosen epochs (at least 1). ``given`` values are taken as they are
    (the spec checks them later); one that is not a number counts as given."""
    values: dict[str, Any] = {}
    if "epochs" not in given:
        epochs = auto_epochs(data.examples)
        values["epochs"] = max(1, min(epochs, max_epochs)) if max_epochs is not None else epochs
    seq = given.get("max_seq_len", HYPERPARAMETER_DEFAULTS["max_seq_len"])
    row = (2 if method == "dpo" else 1) * (seq if isinstance(seq, int) and seq > 0 else 1)
    widened = None
    if "batch_size_tokens" not in given:
        values["batch_size_tokens"], widened = batch_tokens(auto_batch_examples(data.examples), data.mean_tokens,
                                                            row, gpus)
    budget = values.get("batch_size_tokens", given.get("batch_size_tokens"))
    per_step = budget / data.mean_tokens if isinstance(budget, int | float) else auto_batch_examples(data.examples)
    examples = min(per_step, data.examples)      # a step never holds more than the whole file
    if "learning_rate" not in given:
        values["learning_rate"] = learning_rate(examples, parameters)
    return Choice(values=values, batch_size=max(1, round(examples)), widened_from=widened)
