"""Padding-free packing and assistant-only loss targets (pure, torch-free).

Two levels: an optimizer *step* takes whole examples up to
``batch_size_tokens`` tokens (:func:`plan`, the same plan whatever
``max_seq_len`` is); the step is run as micro-batches, packed *rows* of at most
``max_seq_len`` tokens each (:func:`micro_batches`), so the attention length
is bounded by ``max_seq_len`` however large the step is.

A packed row concatenates whole examples; ``position_ids`` restart at 0 for
each example, which makes transformers build a block-diagonal causal mask
(with ``attention_mask=None`` and ``use_cache=False``), so packed examples
never attend to each other. Targets are shifted inside each example, so no
token is ever trained to predict the first token of the next example.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One tokenized conversation; ``loss_mask[i] == 1`` means token i is trained."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    line: int

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Row:
    """One packed row: the model inputs of one forward pass (a micro-batch of a step)."""

    input_ids: list[int]
    position_ids: list[int]
    targets: list[int]

    @property
    def n_targets(self) -> int:
        """Number of tokens that carry loss in this row."""
        return sum(1 for t in self.targets if t != IGNORE)


def targets_for(example: Example) -> list[int]:
    """Return next-token targets: ``t[i] = ids[i+1]`` where token i+1 is trained, else -100."""
    ids, mask = example.input_ids, example.loss_mask
    out = [ids[i + 1] if mask[i + 1] else IGNORE for i in range(len(ids) - 1)]
    out.append(IGNORE)
    return out


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """Return the example order of ``epoch``: a shuffle fixed by ``(seed, epoch)``."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def pack(lengths: list[int], order: list[int], capacity: int) -> list[list[int]]:
    """Greedily pack examples (taken in ``order``) into rows of at most ``capacity`` tokens.

    Returns rows as lists of example indices. Raises:
        ValueError: an example is longer than ``capacity``.
    """
    rows: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index in order:
        length = lengths[index]
        if length > capacity:
            raise ValueError(f"example {index} has {length} tokens > row capacity {capacity}")
        if current and used + length > capacity:
            rows.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        rows.append(current)
    return rows


def plan(lengths: list[int], capacity: int, seed: int, epochs: int) -> list[list[list[int]]]:
    """Return, for each epoch, its optimizer steps: example indices, at most ``capacity`` tokens each.

    Deterministic in ``(lengths, capacity, seed, epochs)``, so a step index names
    the same examples after a restart.
    """
    return [pack(lengths, epoch_order(len(lengths), seed, e), capacity) for e in range(epochs)]


def rows_per_step(steps: list[list[int]], lengths: list[int], capacity: int) -> list[int]:
    """Return how many micro-batch rows of at most ``capacity`` tokens each step of ``steps`` (unit
    indices into ``lengths``) packs into: what :func:`micro_batches` (and DPO's ``pair_rows``) make."""
    return [len(pack([lengths[i] for i in step], list(range(len(step))), capacity)) for step in steps]


def idle_ranks(rows: list[int], world_size: int) -> str | None:
    """A warning when some steps have fewer rows than ranks (``rows``: :func:`rows_per_step`), else None.

    A step's rows are dealt out ``rows[rank::world_size]``, so in such a step the ranks past its
    last row only wait. The plan is not widened here: steps must not depend on the world size (a
    checkpoint resumes on any number of ranks, ``trainer.contract.spec.checkpoint_hash``), so the gateway
    widens the default ``batch_size_tokens`` at create, recorded in the spec, or refuses an explicit
    one; what is left (a short last step of an epoch, examples that pack unevenly) is warned about.
    """
    short = [n for n in rows if n < world_size]
    if world_size <= 1 or not short:
        return None
    return (f"{len(short)} of {len(rows)} steps have fewer rows than the {world_size} ranks (fewest: "
            f"{min(short)}): the ranks without a row wait in those steps; a batch_size_tokens of at least "
            f"{world_size} x the row length keeps every rank busy")


def build_row(examples: list[Example]) -> Row:
    """Concatenate ``examples`` into one padding-free row with per-example positions."""
    ids: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    for example in examples:
        ids.extend(example.input_ids)
        positions.extend(range(len(example)))
        targets.extend(targets_for(example))
    return Row(ids, positions, targets)


def micro_batches(examples: list[Example], capacity: int) -> list[Row]:
    """Split one step's examples, in order, into packed rows of at most ``capacity`` tokens.

    The rows' ``input_ids`` (and targets) concatenated equal those of
    ``build_row(examples)``. Raises:
        ValueError: an example is longer than ``capacity``.
    """
    groups = pack([len(e) for e in examples], list(range(len(examples))), capacity)
    return [build_row([examples[i] for i in group]) for group in groups]


def sequence_bounds(position_ids: list[int]) -> list[int]:
    """Return the cumulative example boundaries of a row (``[0, ..., len(row)]``, flash-attention's cu_seqlens)."""
    starts = [i for i, p in enumerate(position_ids) if p == 0]
    return starts + [len(position_ids)]


def mask_runs(mask: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """Return the ``[start, end)`` spans of consecutive ones in ``mask``."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, bit in enumerate(mask):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def mask_from_spans(length: int, spans: list[tuple[int, int]], weights: list[int]) -> list[int]:
    """Return a loss mask of ``length`` with ones on each span whose weight is 1."""
    mask = [0] * length
    for (start, end), weight in zip(spans, weights, strict=True):
        if weight:
            mask[start:end] = [1] * (end - start)
    return mask
