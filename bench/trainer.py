"""Throughput and peak memory: our trainer vs TRL ``SFTTrainer``, side by side.

Both contenders train the same tiny 4-bit Llama (``trainer.catalog.make_tiny``)
with the same LoRA config (r=8, alpha=16, dropout 0.05, all-linear) on the same
toy chat data, for the same epochs. TRL runs with ``assistant_only_loss=True``
and otherwise its defaults (padded batches of 8, gradient checkpointing, bf16
autocast). Our trainer uses rows of ``8 x mean example length`` tokens, so both
take about the same number of optimizer steps. Each contender runs in its own
process (multiprocessing, spawn); peak memory is that process's ``ru_maxrss``.
Tokens/s counts real (non-pad) tokens over the training loop only.

    python bench/trainer.py [--examples 600] [--epochs 1] [--threads 1] [--trl-fp32]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LORA: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.05}
LEARNING_RATE = 2e-3


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prepare(workdir: Path, examples: int) -> dict[str, Any]:
    """Build the tiny model, register it, write train/validation JSONL; return paths."""
    from trainer.catalog import add, make_tiny
    from trainer.data import sha256_file
    from trainer.toydata import toy_conversations, write_jsonl

    entry = add(make_tiny(workdir / "tiny"), "tiny", workdir / "models")
    train = write_jsonl(workdir / "train.jsonl", toy_conversations(examples, seed=11))
    val = write_jsonl(workdir / "val.jsonl", toy_conversations(24, seed=12))
    return {
        "root": str(workdir / "models"),
        "digest": entry.digest,
        "model": str(workdir / "models" / entry.path),
        "train": str(train),
        "train_sha": sha256_file(train),
        "val": str(val),
        "val_sha": sha256_file(val),
        "workdir": str(workdir),
    }


def run_ours(job: dict[str, Any]) -> dict[str, Any]:
    """Train with trainer.recipe (no final save); return tokens/s and peak RSS."""
    import torch

    torch.set_num_threads(job["threads"])
    from trainer.recipe import Recipe, StopFlag
    from trainer.spec import parse_spec

    spec = parse_spec(
        {
            "base_model": {"name": "tiny", "digest": job["digest"], "catalog_root": job["root"]},
            "train": {"path": job["train"], "sha256": job["train_sha"]},
            "validation": {"path": job["val"], "sha256": job["val_sha"]},
            "hyperparameters": {
                "epochs": job["epochs"],
                "learning_rate": LEARNING_RATE,
                "batch_size_tokens": job["row_tokens"],
                "max_seq_len": 256,
                "lora_r": LORA["r"],
                "lora_alpha": LORA["alpha"],
                "lora_dropout": LORA["dropout"],
                "warmup_steps": 0,
                "gradient_checkpointing": True,
            },
            "job_dir": str(Path(job["workdir"]) / "ours-job"),
            "checkpoint_every_steps": 10_000_000,
        }
    )
    recipe = Recipe(spec, 0, StopFlag())
    recipe.setup()
    recipe.train()
    metrics = recipe.progress.metrics
    tokens = sum(m["tokens"] for m in metrics)
    seconds = metrics[-1]["elapsed_s"]
    recipe.cleanup()
    return {
        "name": "ours (packed, padding-free)",
        "steps": len(metrics),
        "real_tokens": tokens,
        "train_s": seconds,
        "tokens_per_s": tokens / seconds,
        "mean_train_loss": sum(m["loss"] for m in metrics) / len(metrics),
        "peak_rss_mb": _peak_rss_mb(),
    }


def run_trl(job: dict[str, Any]) -> dict[str, Any]:
    """Train with TRL SFTTrainer (assistant_only_loss=True, its defaults otherwise)."""
    import torch

    torch.set_num_threads(job["threads"])
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from trainer.model import load_base_model

    rows = [json.loads(line) for line in Path(job["train"]).read_text().splitlines()]
    for row in rows:  # TRL has no per-message weight; the tokens are the same
        for message in row["messages"]:
            message.pop("weight", None)
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    model = load_base_model(job["model"])
    config = SFTConfig(
        output_dir=str(Path(job["workdir"]) / "trl-out"),
        assistant_only_loss=True,
        num_train_epochs=job["epochs"],
        learning_rate=LEARNING_RATE,
        max_length=256,
        save_strategy="no",
        report_to="none",
        logging_steps=10_000,
        disable_tqdm=True,
        lr_scheduler_type="linear",
        warmup_steps=0,
        use_cpu=not torch.cuda.is_available(),
        bf16=not job.get("trl_fp32", False),  # True is TRL's own default
    )
    peft_config = LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    dataset: Any = trainer.train_dataset
    per_epoch = sum(len(ids) for ids in dataset["input_ids"])
    t0 = time.monotonic()
    output = trainer.train()
    seconds = time.monotonic() - t0
    tokens = per_epoch * job["epochs"]
    return {
        "name": "TRL SFTTrainer" + (" (bf16=False)" if job.get("trl_fp32") else ""),
        "steps": output.global_step,
        "real_tokens": tokens,
        "train_s": seconds,
        "tokens_per_s": tokens / seconds,
        "mean_train_loss": output.training_loss,
        "peak_rss_mb": _peak_rss_mb(),
    }


def _in_fresh_process(fn: Any, job: dict[str, Any]) -> dict[str, Any]:
    with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(fn, (job,))


def _mean_length(job: dict[str, Any]) -> float:
    from transformers import AutoTokenizer

    from trainer.data import read_conversations, tokenize_all

    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    examples = tokenize_all(tokenizer, read_conversations(job["train"], "train"), 256, "train")
    return sum(len(e) for e in examples) / len(examples)


def main() -> None:
    """Run both contenders and print tokens/s, peak RSS and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=600)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--trl-fp32", action="store_true", help="also run TRL with bf16=False (its default is bf16 autocast)"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        job = prepare(Path(tmp), args.examples)
        job.update(epochs=args.epochs, threads=args.threads)
        job["row_tokens"] = max(16, math.ceil(8 * _mean_length(job)))
        print(
            f"tiny model, {args.examples} examples x {args.epochs} epochs, "
            f"threads={args.threads}, our row = {job['row_tokens']} tokens (~8 examples)"
        )
        results = [_in_fresh_process(run_ours, job), _in_fresh_process(run_trl, job)]
        if args.trl_fp32:
            results.append(_in_fresh_process(run_trl, {**job, "trl_fp32": True}))
    for r in results:
        print(
            f"{r['name']:30s} steps {r['steps']:5d}  real tokens {r['real_tokens']:7d}  "
            f"train {r['train_s']:6.1f} s  {r['tokens_per_s']:7.0f} tok/s  "
            f"peak RSS {r['peak_rss_mb']:6.0f} MB  mean train loss {r['mean_train_loss']:.3f}"
        )
    ours = results[0]
    for trl in results[1:]:
        print(
            f"ratio ours / {trl['name']}: {ours['tokens_per_s'] / trl['tokens_per_s']:.2f}x "
            f"tokens/s, {ours['peak_rss_mb'] / trl['peak_rss_mb']:.2f}x peak RSS "
            "(goal: >= 1.8x tokens/s, <= 1.0x memory)"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
