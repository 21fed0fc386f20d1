"""Run one optimizer step of the real recipe in this fresh process; print what it cost as JSON.

Usage: ``python step_memory_probe.py SPEC.json``. Prints ``extra_mib`` (peak RSS
growth from the end of setup through the "before" eval and step 1),
``lengths`` (the sequence length of every decoder forward) and step 1's metrics.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any

from trainer.contract.spec import load_spec
from trainer.model import decoder_and_head
from trainer.recipe import Recipe, StopFlag


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(spec_path: str) -> None:
    recipe = Recipe(load_spec(spec_path), 0, StopFlag())
    recipe.setup()
    lengths: list[int] = []
    parts = decoder_and_head(recipe.model)
    assert parts is not None

    def record(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        lengths.append(int(kwargs["input_ids"].shape[-1]))

    parts[0].register_forward_pre_hook(record, with_kwargs=True)
    before = _peak_mib()
    recipe.train()
    extra = _peak_mib() - before
    recipe.cleanup()
    print(json.dumps({"extra_mib": extra, "lengths": lengths, "metric": recipe.progress.metrics[0]}))


if __name__ == "__main__":
    main(sys.argv[1])
