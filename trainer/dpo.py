"""Direct preference optimisation (DPO, Rafailov et al. 2023) on the QLoRA base.

Input is OpenAI's preference JSONL: one ``{"input": {"messages": [...]},
"preferred_output": [assistant message], "non_preferred_output": [assistant
message]}`` per line. Each side is tokenized as the conversation ``input +
[that side]`` with the base model's chat template; only the side's own
assistant tokens are trained (``loss_mask``), like the last turn of a chat.

The loss of a pair is the sigmoid loss ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))``
where ``pc``/``pr`` are the policy's summed log-probabilities of the chosen and
rejected side and ``rc``/``rr`` the reference's. The reference is the policy as
training starts (the 4-bit base with the freshly initialised LoRA, whose B is
zero: the base itself; or the parent's adapter when continuing a supervised
model), its log-probabilities computed once in setup (:func:`reference_logps`)
and kept in every checkpoint: no second model in memory, no reference forward
per step, and a resume scores against the very same numbers.

Packing: a pair is one unit of the step plan (whole pairs up to
``batch_size_tokens`` tokens, the plan of ``trainer.packing``), and a
micro-batch row holds whole pairs, chosen then rejected (:func:`pair_rows`):
both sides of a pair are in one forward, at most ``2 * max_seq_len`` tokens
per row. The step's loss is the mean over its pairs, as if they were one batch.

Metrics of a set of pairs (:func:`preference_metrics`): the mean loss, the
implicit rewards ``beta * (policy - reference)`` of each side, their margin,
``reward_accuracy`` (the share of pairs whose chosen reward is above the
rejected one; a tie counts one half, so the reference itself scores 0.5) and
``logp_accuracy`` (the share whose chosen side is more likely than the
rejected one under the policy alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.contract.errors import DatasetError
from trainer.contract.lines import PREFERENCE
from trainer.contract.lines import Preference as PreferenceLine
from trainer.data import ChatTokenizer, Conversation, read_lines, tokenize_conversation
from trainer.packing import Example, Row, build_row, pack

if TYPE_CHECKING:
    import torch

@dataclass(frozen=True)
class Preference:
    """One validated dataset line: the prompt and the two answers to it."""

    line: int
    prompt: list[dict[str, str]]
    chosen: str
    rejected: str


@dataclass(frozen=True)
class Pair:
    """One tokenized preference: both sides as examples (same prompt, own trained tokens)."""

    chosen: Example
    rejected: Example
    line: int

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


@dataclass(frozen=True)
class PairRow:
    """One packed row of whole pairs (chosen, rejected, chosen, ...) and the pairs' indices."""

    row: Row
    pairs: list[int]


# ----------------------------------------------------------------- reading


def read_pairs(path: str | Path, what: str) -> list[Preference]:
    """Read and validate every line of a preference JSONL file (blank lines are skipped), by the
    contract's grammar (``trainer.data.read_lines``). A prompt message's ``name`` is accepted and
    dropped: the chat template renders role and content only.

    Raises:
        DatasetError: naming the first invalid line (never its text).
    """
    pairs = []
    for number, line in read_lines(path, what, PREFERENCE):
        assert isinstance(line, PreferenceLine)  # a PREFERENCE reader reads preference lines only
        pairs.append(Preference(number, [m.turn() for m in line.prompt], line.chosen, line.rejected))
    if not pairs:
        raise DatasetError(f"{what} dataset {path}: no preference pairs")
    return pairs


def _side_example(tokenizer: ChatTokenizer, pref: Preference, content: str, what: str) -> Example:
    """``prompt + [content]`` tokenized; only ``content``'s assistant tokens trained."""
    messages = [*pref.prompt, {"role": "assistant", "content": content}]
    weights = [0] * sum(m["role"] == "assistant" for m in pref.prompt) + [1]
    return tokenize_conversation(tokenizer, Conversation(pref.line, messages, weights), what)


def tokenize_pairs(tokenizer: ChatTokenizer, prefs: list[Preference], max_seq_len: int, what: str) -> list[Pair]:
    """Tokenize both sides of every pair; refuse a side longer than ``max_seq_len``.

    Raises:
        DatasetError: naming the line and its token count (prompt + the longer side).
    """
    pairs = []
    for pref in prefs:
        chosen = _side_example(tokenizer, pref, pref.chosen, what)
        rejected = _side_example(tokenizer, pref, pref.rejected, what)
        longest = max(len(chosen), len(rejected))
        if longest > max_seq_len:
            raise DatasetError(
                f"{what} dataset line {pref.line}: prompt + longer side is {longest} tokens > max_seq_len "
                f"{max_seq_len}; shorten that pair or raise hyperparameters.max_seq_len"
            )
        if not any(chosen.loss_mask) or not any(rejected.loss_mask):
            raise DatasetError(f"{what} dataset line {pref.line}: a side has no trained tokens")
        pairs.append(Pair(chosen, rejected, pref.line))
    return pairs


# ----------------------------------------------------------------- rows


def pair_rows(pairs: list[Pair], indices: list[int], capacity: int) -> list[PairRow]:
    """Pack the pairs ``indices`` (in order) into rows of whole pairs of at most ``capacity`` tokens.

    Raises:
        ValueError: a pair is longer than ``capacity``.
    """
    groups = pack([len(pairs[i]) for i in indices], list(range(len(indices))), capacity)
    rows = []
    for group in groups:
        members = [indices[g] for g in group]
        sides = [side for i in members for side in (pairs[i].chosen, pairs[i].rejected)]
        rows.append(PairRow(build_row(sides), members))
    return rows


# ----------------------------------------------------------------- loss


def dpo_terms(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair sigmoid DPO loss and implicit rewards.

    ``policy``/``reference``: ``(n, 2)`` summed log-probabilities (chosen, rejected).
    Returns ``(loss (n,), rewards (n, 2))`` with ``rewards = beta * (policy - reference)``.
    """
    import torch.nn.functional as F  # lazy: torch; reading and packing pairs need none of it

    rewards = beta * (policy - reference.to(policy.device, policy.dtype))
    return -F.logsigmoid(rewards[:, 0] - rewards[:, 1]), rewards


@dataclass
class PreferenceSums:
    """Additive sums over pairs (ranks add theirs up), turned into metrics by :func:`preference_metrics`."""

    pairs: int = 0
    loss: float = 0.0
    loss_sq: float = 0.0          # sum of squared per-pair losses: the eval's spread
    chosen_reward: float = 0.0
    rejected_reward: float = 0.0
    reward_correct: float = 0.0   # a tie counts 0.5
    logp_correct: float = 0.0
    tokens: int = 0

    def add(self, loss: torch.Tensor, rewards: torch.Tensor, policy: torch.Tensor, tokens: int) -> None:
        """Add one row's pairs (detached values)."""
        import torch  # lazy: torch; reading and packing pairs need none of it

        loss, rewards, policy = loss.detach().double(), rewards.detach().double(), policy.detach().double()
        margin = rewards[:, 0] - rewards[:, 1]
        self.pairs += int(loss.numel())
        self.loss += float(loss.sum())
        self.loss_sq += float((loss * loss).sum())
        self.chosen_reward += float(rewards[:, 0].sum())
        self.rejected_reward += float(rewards[:, 1].sum())
        self.reward_correct += float((margin > 0).double().sum() + 0.5 * (margin == 0).double().sum())
        self.logp_correct += float(torch.gt(policy[:, 0], policy[:, 1]).double().sum()
                                   + 0.5 * torch.eq(policy[:, 0], policy[:, 1]).double().sum())
        self.tokens += tokens

    def as_list(self) -> list[float]:
        """The sums as floats, for one ``World.sum_floats`` collective."""
        return [float(self.pairs), self.loss, self.loss_sq, self.chosen_reward, self.rejected_reward,
                self.reward_correct, self.logp_correct, float(self.tokens)]

    @classmethod
    def from_list(cls, values: list[float]) -> PreferenceSums:
        """The inverse of :meth:`as_list` (after the ranks' sums were added up)."""
        pairs, loss, loss_sq, chosen, rejected, reward_ok, logp_ok, tokens = values
        return cls(int(pairs), loss, loss_sq, chosen, rejected, reward_ok, logp_ok, int(tokens))


def preference_metrics(sums: PreferenceSums) -> dict[str, float | None]:
    """The metrics of a set of pairs: mean loss (and its standard error), rewards, margin, accuracies."""
    n = max(sums.pairs, 1)
    mean = sums.loss / n
    var = (sums.loss_sq - sums.loss * sums.loss / n) / (n - 1) if sums.pairs > 1 else None
    return {
        "loss": mean,
        "loss_stderr": math.sqrt(max(var, 0.0) / n) if var is not None else None,
        "chosen_reward": sums.chosen_reward / n,
        "rejected_reward": sums.rejected_reward / n,
        "reward_margin": (sums.chosen_reward - sums.rejected_reward) / n,
        "reward_accuracy": sums.reward_correct / n,
        "logp_accuracy": sums.logp_correct / n,
        "pairs": sums.pairs,
        "tokens": sums.tokens,
    }


def _row_policy(model: Any, row: PairRow) -> torch.Tensor:
    from trainer.model import row_logps  # lazy: trainer.model imports torch

    return row_logps(model, row.row).view(-1, 2)


def accumulate_pair_gradients(model: Any, rows: list[PairRow], total_pairs: int, reference: torch.Tensor,
                              beta: float) -> PreferenceSums:
    """Forward and backward each row of one optimizer step; the gradients are those of the mean
    DPO loss over the step's ``total_pairs`` pairs (on all ranks: each passes its own rows).
    ``reference``: ``(pairs in the dataset, 2)``. Returns this rank's sums."""
    sums = PreferenceSums()
    for row in rows:
        policy = _row_policy(model, row)
        loss, rewards = dpo_terms(policy, reference[row.pairs], beta)
        (loss.sum() / total_pairs).backward()
        sums.add(loss, rewards, policy, row.row.n_targets)
    return sums


def _scored(model: Any, rows: list[PairRow], check: Callable[[], None] | None) -> Iterator[tuple[PairRow, Any]]:
    """Yield each row with its ``(pairs, 2)`` log-probabilities, in eval mode without gradients
    (``check`` before each row; train mode again afterwards)."""
    import torch  # lazy: torch; reading and packing pairs need none of it

    model.eval()
    try:
        with torch.no_grad():
            for row in rows:
                if check is not None:
                    check()
                yield row, _row_policy(model, row)
    finally:
        model.train()


def eval_pair_sums(model: Any, rows: list[PairRow], reference: torch.Tensor, beta: float,
                   check: Callable[[], None] | None = None) -> PreferenceSums:
    """The sums of :class:`PreferenceSums` over ``rows`` without gradients (``check`` before each row)."""
    sums = PreferenceSums()
    for row, policy in _scored(model, rows, check):
        loss, rewards = dpo_terms(policy, reference[row.pairs], beta)
        sums.add(loss, rewards, policy, row.row.n_targets)
    return sums


def reference_logps(model: Any, rows: list[PairRow], n_pairs: int, check: Callable[[], None] | None = None
                    ) -> torch.Tensor:
    """The ``(n_pairs, 2)`` summed log-probabilities of the pairs of ``rows`` under ``model`` as it is now
    (eval mode, no gradients); pairs not in ``rows`` (another rank's) stay 0, so ranks can add theirs up."""
    import torch  # lazy: torch; reading and packing pairs need none of it

    out = torch.zeros(n_pairs, 2, dtype=torch.float32)
    for row, policy in _scored(model, rows, check):
        out[row.pairs] = policy.float().cpu()
    return out
