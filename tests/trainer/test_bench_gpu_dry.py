"""``bench/gpu.sh --dry`` starts and runs every code path it can without CUDA (the GPU script is
only ever run for real on a GPU machine; this is how we know it starts there)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.train

REPO = Path(__file__).resolve().parents[2]


def test_gpu_script_dry_mode_prints_one_json_line() -> None:
    env = {**os.environ, "SFT_PY": sys.executable, "SFT_GPU_DRY": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["bash", "bench/gpu.sh"], cwd=REPO, env=env, capture_output=True,  # noqa: S603
                         text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["bench"] == "gpu" and out["dry"] is True and out["cuda"] is False
    assert "not_run" in out["wipe"] and "CUDA" in out["wipe"]["not_run"]

    bnb = out["bnb_4bit"]
    assert "error" not in bnb, bnb
    assert bnb["quant_type"] == "nf4" and bnb["ok"] is False and "CUDA" in bnb["not_run"]
    assert bnb["model_layer"]["rel_err"] < 1e-2
    assert 0 < bnb["standalone"]["nf4_rel_rmse_vs_original"] < 0.2  # NF4 is lossy, but not noise

    for shape in ("llama-1b", "llama3-8b-slice"):
        part = out[f"throughput_{shape}"]
        assert "error" not in part, part
        assert "CUDA" in part["not_run"]
        names = [r["name"] for r in part["runs"]]
        assert names == ["ours", "trl-best"]
        for run in part["runs"]:
            assert run["timed_steps"] >= 2 and run["tokens_per_s"] > 0
            assert math.isfinite(run["eval_loss"]) and run["eval"]["tokens"] > 0
        # the same data, counted from the data: both saw every training token once
        assert len({r["total_tokens"] for r in part["runs"]}) == 1
        # one attention kernel for both (ours: sft_varlen on the CPU), so the trainers are compared, not kernels
        assert [r["attention"] for r in part["runs"]] == ["sft_varlen", "sft_varlen"]
        flops = part["model_flops"]
        assert flops["tokens"] == part["runs"][0]["total_tokens"]
        assert 0 < flops["head"] < flops["total"] and part["flops_per_token"] == flops["total"] / flops["tokens"]
        trl = part["runs"][1]
        assert trl["lora_dtypes"] == {"torch.float32": sum(trl["lora_dtypes_as_built_by_trl"].values())}
        assert part["medians"]["ours"]["mfu"] is None  # no peak figure for a CPU
        assert set(part["vs_trl_best"]) >= {"tokens_per_s_ratio", "memory_ratio", "goal_met"}
