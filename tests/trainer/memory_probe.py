"""Measure what one job's setup and first optimizer step cost this fresh process, as JSON.

Usage: ``python memory_probe.py SPEC.json``. Prints (MiB):

* ``runtime``: RSS once the trainer stack is imported (python, torch, transformers,
  peft, bitsandbytes), before any model: :data:`trainer.memory.CPU_RUNTIME_BYTES`'s term;
* ``load_peak``: peak RSS growth over ``runtime`` during setup (loading, LoRA, DPO's reference);
* ``resident``: RSS growth over ``runtime`` after setup (the model as it trains);
* ``step_peak``: peak RSS growth over ``runtime`` during the "before" eval and step 1 (the
  peak counter is reset after setup through ``/proc/self/clear_refs``, so the load does not
  hide it); ``rows``: ``(tokens, trained tokens, longest example)`` of each of step 1's rows;
* ``step_growth``: peak RSS growth over what setup left (``step_peak`` less ``resident``: what the
  step itself adds, the DPO-vs-supervised comparison's measure);
* ``lengths``: the sequence length of every decoder forward (the "before" eval, step 1, DPO's
  reference); ``metric``: step 1's metrics.

The heap is set up first as a trainer process's (``trainer.heap.map_large_blocks``, where that
module exists: glibc's mmap threshold fixed before anything is loaded).

What :func:`trainer.memory.estimate` predicts is compared with ``step_peak`` and ``load_peak``
(tests/trainer/test_memory_estimate_measured.py, which also compares DPO's step with the
supervised one from the same runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _status(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise AssertionError(f"no {key} in /proc/self/status")


def _longest(bounds: list[int]) -> int:
    return max(b - a for a, b in zip(bounds, bounds[1:], strict=False))


def main(spec_path: str) -> None:
    try:  # the heap as a trainer process has it from its start (trainer.heap, where it exists)
        from trainer.heap import map_large_blocks
    except ImportError:
        pass
    else:
        map_large_blocks()
    import bitsandbytes  # noqa: F401 - the runtime baseline holds the whole stack
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from trainer.contract.spec import load_spec
    from trainer.dpo import pair_rows
    from trainer.model import decoder_and_head
    from trainer.packing import micro_batches, sequence_bounds
    from trainer.recipe import Recipe, StopFlag

    spec = load_spec(spec_path)
    recipe = Recipe(spec, 0, StopFlag())
    runtime = _status("RssAnon")
    recipe.setup()
    load_peak = _status("VmHWM") - _status("RssFile") - _status("RssShmem") - runtime
    resident, mapped = _status("RssAnon") - runtime, _status("RssFile")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    _, indices = recipe.steps[0]
    if recipe.preference:
        packed = [r.row for r in pair_rows(recipe.train_examples, indices, 2 * recipe.hp.max_seq_len)]
    else:
        packed = micro_batches([recipe.train_examples[i] for i in indices], recipe.hp.max_seq_len)
    rows = [(len(r.input_ids), r.n_targets, _longest(sequence_bounds(r.position_ids))) for r in packed]
    lengths: list[int] = []
    parts = decoder_and_head(recipe.model)
    assert parts is not None

    def record(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        lengths.append(int(kwargs["input_ids"].shape[-1]))

    parts[0].register_forward_pre_hook(record, with_kwargs=True)
    recipe.train()
    step_peak = _status("VmHWM") - mapped - _status("RssShmem") - runtime
    recipe.cleanup()
    print(json.dumps({"runtime": runtime, "load_peak": load_peak, "resident": resident, "step_peak": step_peak,
                      "step_growth": step_peak - resident, "mapped": mapped, "rows": rows, "lengths": lengths,
                      "metric": recipe.progress.metrics[0]}))


if __name__ == "__main__":
    main(sys.argv[1])
