"""`finetune artifacts export` end to end, against a real `gateway serve` on the real cluster:
a job trains and publishes; `--format vllm` writes an adapter that passes vLLM's loader checks
and prints the serving command; `--format merged` writes a model plain transformers loads,
whose logits equal the 4-bit base + adapter's; a rank above --max-lora-rank and an existing
output are clear errors, never a traceback. (vLLM is not installed: only its loader's checks run.)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.slurm.livegateway import MODEL, STORAGE, LiveGateway, chat_file

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]
A = "t-export-a"
FAST = ["--epochs", "1", "--batch-size-tokens", "512", "--max-seq-len", "256",
        "--learning-rate-multiplier", "10", "--hp", "checkpoint_every_steps=3"]


class Cli:
    """`python -m gateway ...` as tenant A: a fresh process each time, like a user's shell
    (the pattern of tests/slurm/test_cli_jobs.py)."""

    def __init__(self, gw: LiveGateway):
        self.gw = gw

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        env = {**self.gw.env, "SFT_API_URL": self.gw.url, "SFT_API_TOKEN": self.gw.tokens[A]}
        res = subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=timeout)
        assert "Traceback" not in res.stderr, res.stderr
        if check and res.returncode != 0:
            raise AssertionError(f"finetune {' '.join(args)} exited {res.returncode}: {res.stderr}")
        return res


@pytest.fixture(scope="module")
def cli(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    gw = LiveGateway(tmp_path_factory.mktemp("export"), (A,))
    try:
        yield Cli(gw)
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def job(cli: Cli, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = chat_file(tmp_path_factory.mktemp("data") / "train.jsonl", 80, seed=41)
    upload = json.loads(cli("files", "upload", str(path), "--json").stdout)
    created = json.loads(cli("jobs", "create", "--training-file", upload["id"], "--model", MODEL, *FAST,
                             "--lora-r", "16", "--json").stdout)
    lines = cli("jobs", "follow", created["id"], "--json", "--interval", "0.5").stdout.splitlines()
    final = json.loads(lines[-1])
    assert final["status"] == "succeeded", final
    return dict(final)


def _logits(model: Any, ids: Any) -> Any:
    import torch

    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_export_vllm_then_merged(cli: Cli, job: dict[str, Any], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer import catalog
    from trainer.export import vllm_problems
    from trainer.model import load_base_model

    adapter = tmp_path / "vllm"
    res = cli("artifacts", "export", job["id"], "--format", "vllm", "-o", str(adapter))
    assert "vllm serve" in res.stdout and "--enable-lora" in res.stdout and "--max-lora-rank 16" in res.stdout
    assert f"{job['fine_tuned_model']}={adapter.resolve()}" in res.stdout
    assert vllm_problems(adapter, max_lora_rank=16) == []
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == MODEL
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no download or temp dir left"

    small = cli("artifacts", "export", job["id"], "--format", "vllm", "-o", str(tmp_path / "r8"),
                "--max-lora-rank", "8", check=False)
    assert small.returncode == 1 and "problem: LoRA rank r=16 is greater than --max-lora-rank 8" in small.stderr
    taken = cli("artifacts", "export", job["id"], "--format", "vllm", "-o", str(adapter), check=False)
    assert taken.returncode == 1 and "exists and is not empty" in taken.stderr

    merged = tmp_path / "merged"
    res = cli("artifacts", "export", job["id"], "--format", "merged", "-o", str(merged), "--dtype", "float32",
              "--models-root", str(STORAGE / "models"), timeout=600)
    assert f"AutoModelForCausalLM.from_pretrained({str(merged.resolve())!r})" in res.stdout
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())

    entry = next(e for e in catalog.list_models(STORAGE / "models") if e.name == MODEL)
    base = catalog.resolve(STORAGE / "models", MODEL, entry.digest)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "The apple and the river count 12."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    want = _logits(PeftModel.from_pretrained(load_base_model(base, "cpu"), str(adapter)), ids)
    got = _logits(AutoModelForCausalLM.from_pretrained(merged), ids)
    assert float((got - want).abs().max()) / float(want.abs().max()) < 1e-5


def test_export_a_checkpoint_for_serving(cli: Cli, job: dict[str, Any], tmp_path: Path) -> None:
    """A published checkpoint exports like the final adapter, under its own model name; a step that
    was never published is a clear error naming those that were."""
    from safetensors.torch import load_file

    from trainer.export import vllm_problems

    steps = sorted(c["step_number"] for c in json.loads(cli("jobs", "checkpoints", job["id"], "--json").stdout)["data"]
                   if c["adapter_file"])
    assert steps, "checkpoint_every_steps=3 keeps two checkpoints"
    out = tmp_path / "ckpt"
    res = cli("artifacts", "export", job["id"], "--format", "vllm", "--checkpoint", str(steps[0]), "-o", str(out))
    assert f"{job['fine_tuned_model']}:ckpt-step-{steps[0]}={out.resolve()}" in res.stdout
    assert vllm_problems(out, max_lora_rank=16) == []
    final = tmp_path / "final"
    cli("artifacts", "export", job["id"], "--format", "vllm", "-o", str(final))
    mine, theirs = load_file(out / "adapter_model.safetensors"), load_file(final / "adapter_model.safetensors")
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    assert any(not bool((mine[k] == theirs[k]).all()) for k in mine), "an earlier step's weights, not the final"
    missing = cli("artifacts", "export", job["id"], "--format", "vllm", "--checkpoint", "1",
                  "-o", str(tmp_path / "none"), check=False)
    assert missing.returncode == 1 and f"published: {', '.join(map(str, steps))}" in missing.stderr
