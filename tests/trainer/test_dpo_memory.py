"""DPO in the memory a real model needs (issue 29): on SmolLM2-135M a DPO step costs at most 1.5x the
supervised step on the same data size and settings, and stays far below the job's 8 GB limit."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import REPO, trainer_env, write_spec

pytestmark = [pytest.mark.train, pytest.mark.slow]

CATALOG = Path("/srv/slurm-finetune/models")
PROBE = Path(__file__).with_name("step_memory_probe.py")
EXAMPLES = 60          # the size of the job that was killed (60 short preference pairs, defaults)
STEP_LIMIT_MIB = 1536  # the step on top of setup; 09dac64 added 5.5 GB for DPO and 4.2 GB for SFT


def _smollm2() -> dict[str, Any]:
    index = CATALOG / "index.json"
    models = json.loads(index.read_text())["models"] if index.is_file() else []
    found = [m for m in models if m["name"].startswith("smollm2")]
    if not found:
        pytest.skip(f"no SmolLM2 in the catalog {CATALOG} (finetune models import-smollm2)")
    return dict(found[0])


def _step(method: str, tmp_path: Path) -> dict[str, Any]:
    """Step 1 of the real recipe (defaults, ``max_steps`` 1) in a fresh process: its peak RSS growth."""
    from trainer.toydata import toy_conversations, toy_preferences, write_jsonl

    rows = toy_preferences(EXAMPLES, seed=1) if method == "dpo" else toy_conversations(EXAMPLES, seed=1)
    train = write_jsonl(tmp_path / f"{method}.jsonl", rows)
    model = _smollm2()
    spec = {"base_model": {"name": model["name"], "digest": model["digest"], "catalog_root": str(CATALOG)},
            "train": {"path": str(train), "sha256": hashlib.sha256(train.read_bytes()).hexdigest()},
            "job_dir": str(tmp_path / f"job-{method}"), "method": method, "checkpoint_every_steps": 1000,
            "hyperparameters": {"max_steps": 1}}
    done = subprocess.run([sys.executable, str(PROBE), str(write_spec(spec, tmp_path / f"{method}.json"))],
                          cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_smollm2_dpo_step_costs_at_most_1_5x_the_supervised_step(tmp_path: Path) -> None:
    sft = _step("supervised", tmp_path)
    dpo = _step("dpo", tmp_path)
    ratio = dpo["extra_mib"] / sft["extra_mib"]
    print(f"\nSmolLM2, {EXAMPLES} examples, defaults: step peak RSS growth DPO {dpo['extra_mib']:.0f} MiB "
          f"(longest forward {max(dpo['lengths'])} tokens) vs supervised {sft['extra_mib']:.0f} MiB "
          f"({max(sft['lengths'])}): {ratio:.2f}x")
    assert dpo["metric"]["trained_tokens"] > 0 and sft["metric"]["trained_tokens"] > 0
    assert max(dpo["lengths"]) > 1.5 * max(sft["lengths"])  # DPO rows do hold both sides of their pairs
    assert ratio <= 1.5
    assert dpo["extra_mib"] < STEP_LIMIT_MIB and sft["extra_mib"] < STEP_LIMIT_MIB
