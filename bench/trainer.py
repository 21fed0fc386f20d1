"""Throughput, peak memory and eval loss: our trainer vs TRL ``SFTTrainer`` in its best configuration.

Both contenders train the same 4-bit NF4 model (``trainer.catalog.make_tiny`` here, other shapes
from ``bench/gpu.py``) with the same LoRA (r, alpha, dropout: the production default, all-linear),
optimizer (AdamW, same lr, betas, eps, weight decay 0), schedule (linear, same warmup), gradient
checkpointing (non-reentrant), max grad norm 1.0 and tokens per optimizer step, on the same toy
chats. The peer runs in the configuration TRL documents as its fastest for the hardware (see
``trl_best_config``, printed at the start): packed (BFD, padding-free), fp32 compute and fp32 LoRA
weights on CPU, bf16 on CUDA.

Same attention kernel (``--attention same``, the default): TRL's model keeps the attention
``trainer.model.load_base_model`` picked for ours (``sft_varlen`` on the CPU and on a GPU without
flash-attn, ``flash_attention_2`` with it); TRL's padding-free collator passes the same
``cu_seq_lens`` our rows do. Otherwise the kernel, not the trainer, would be measured: TRL on SDPA
builds a dense block mask per packed row where ours runs per example. ``--attention own`` gives
TRL its own documented choice (SDPA, or flash-attention 2 where installed) for reference.

Fair timing: each contender runs in its own fresh spawned process; its clock starts after its first
optimizer step (warm-up) and stops after its last. Tokens are counted from the data, the same way
for both: the tokenized length of every example a step trained on (ours: the examples of each
planned step; TRL: those of each packed row its collator received). Not TRL's own
``num_input_tokens_seen``: it drops every token equal to the pad id, and on SmolLM2 pad = eos.
Repeats alternate (ours, TRL, ours, TRL, ...); medians are reported. Both trained adapters are then
scored by one function (``eval_loss``: ``trainer.model.evaluate`` over our tokenization of the
validation file, token-weighted mean CE over assistant tokens).

    python bench/trainer.py [--examples 600] [--epochs 1] [--threads 1] [--repeats 3] [--attention same|own]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

def _production_dropout() -> float:
    """The job spec's default ``lora_dropout``: what production trains SFT with (DPO: none, see bench/dpo.py)."""
    from trainer.contract.spec import Hyperparameters

    return float(Hyperparameters.model_fields["lora_dropout"].default)


# dropout is not put in our spec (production's default applies); TRL's LoraConfig gets the same value
LORA: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": _production_dropout(), "target_modules": "all-linear"}
LEARNING_RATE = 2e-3
WARMUP_STEPS = 0  # with 0 both schedules are the same formula: lr * (total - step) / total
MAX_GRAD_NORM = 1.0
SEED = 0
# torch.optim.AdamW defaults, which trainer/recipe.py uses (weight_decay=0.0 set there explicitly)
ADAM = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "weight_decay": 0.0}
GOAL = {"tokens_per_s_ratio": 1.8, "memory_ratio": 0.75}
OURS, TRL_BEST, TRL_DEFAULTS = "ours", "trl-best", "trl-defaults (handicapped)"


def quiet() -> None:
    """Known-harmless library noise (trainer.quiet) and datasets' progress bars off; call before torch."""
    import os

    from trainer.quiet import quiet_libraries

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    quiet_libraries()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_cuda_mb() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


# ----------------------------------------------------------------- data and model


def unweighted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop per-message ``weight`` keys: TRL has none, so both train on every assistant turn."""
    return [{"messages": [{k: v for k, v in m.items() if k != "weight"} for m in r["messages"]]} for r in rows]


def write_data(workdir: Path, train_rows: list[dict[str, Any]], val_rows: list[dict[str, Any]]) -> dict[str, str]:
    """Write the (unweighted) train/validation JSONL files; return their paths and sha256s."""
    from trainer.data import sha256_file
    from trainer.toydata import write_jsonl

    train = write_jsonl(workdir / "train.jsonl", unweighted(train_rows))
    val = write_jsonl(workdir / "val.jsonl", unweighted(val_rows))
    return {"train": str(train), "train_sha": sha256_file(train), "val": str(val), "val_sha": sha256_file(val)}


def register(built: Path, name: str, workdir: Path) -> dict[str, str]:
    """Register a built model directory in a temp catalog; return the job's model fields."""
    from trainer.catalog import add

    entry = add(built, name, workdir / "models")
    root = workdir / "models"
    return {"root": str(root), "name": name, "digest": entry.digest, "model": str(root / entry.path)}


def prepare(workdir: Path, examples: int, model: str = "tiny") -> dict[str, Any]:
    """Build the model (``tiny``: the random tiny Llama; ``smollm2``: SmolLM2-135M-Instruct from
    its PyPI wheel), register it, write train/validation JSONL; return the job fields."""
    from trainer.catalog import import_smollm2, make_tiny
    from trainer.toydata import toy_conversations

    job: dict[str, Any] = {"workdir": str(workdir)}
    if model == "smollm2":
        job.update(register(import_smollm2(workdir / "smollm2"), "smollm2", workdir))
    else:
        job.update(register(make_tiny(workdir / "tiny"), "tiny", workdir))
    job.update(write_data(workdir, toy_conversations(examples, seed=11), toy_conversations(24, seed=12)))
    return job


def data_counts(job: dict[str, Any]) -> dict[str, Any]:
    """Our tokenization of the training file: each example's length (``lengths``, in file order) and
    its trained (assistant) tokens (``trained``): the token counts of the data, for both contenders."""
    from transformers import AutoTokenizer

    from trainer.data import read_conversations, tokenize_all

    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    examples = tokenize_all(tokenizer, read_conversations(job["train"], "train"), 1 << 20, "train")
    return {"lengths": [len(e) for e in examples], "trained": [sum(e.loss_mask) for e in examples]}


def active_dropout(model: Any) -> int:
    """How many dropout modules (``torch.nn.Dropout`` with p > 0, attention modules with
    ``attention_dropout`` > 0) would drop units in training: printed for both, so a run shows what it trained with."""
    import torch

    return sum(1 for m in model.modules()
               if (isinstance(m, torch.nn.Dropout) and m.p > 0)
               or (isinstance(getattr(m, "attention_dropout", None), float) and m.attention_dropout > 0))


def eval_loss(model: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The one scoring function for both: token-weighted mean CE over the validation file's assistant tokens."""
    from transformers import AutoTokenizer

    from trainer.data import read_conversations, tokenize_all
    from trainer.model import evaluate

    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    examples = tokenize_all(tokenizer, read_conversations(job["val"], "validation"), job["step_tokens"], "validation")
    return evaluate(model, examples, job["step_tokens"])


def _timed(marks: list[tuple[float, int]]) -> dict[str, Any]:
    """From (time, cumulative real tokens) at the end of each optimizer step: the steps after the first."""
    if len(marks) < 3:
        raise SystemExit(f"only {len(marks)} optimizer steps: too few to time after a warm-up step; add --examples")
    (t0, n0), (t1, n1) = marks[0], marks[-1]
    return {"timed_steps": len(marks) - 1, "timed_tokens": n1 - n0, "timed_s": t1 - t0,
            "tokens_per_s": (n1 - n0) / (t1 - t0), "total_tokens": n1}


def _finish(name: str, model: Any, job: dict[str, Any], steps: int, marks: list[tuple[float, int]],
            mean_train_loss: float) -> dict[str, Any]:
    result: dict[str, Any] = {"name": name, "steps": steps, **_timed(marks), "mean_train_loss": mean_train_loss}
    result["lora_dtypes"] = dict(Counter(str(p.dtype) for p in model.parameters() if p.requires_grad))
    result["attention"] = str(model.config._attn_implementation)
    result["active_dropout"] = active_dropout(model)
    result["eval"] = eval_loss(model, job)
    result["eval_loss"] = result["eval"]["loss"]
    result["peak_rss_mb"] = _peak_rss_mb()
    result["peak_cuda_mb"] = _peak_cuda_mb()
    return result


# ----------------------------------------------------------------- ours


def our_spec(job: dict[str, Any]) -> dict[str, Any]:
    """The job spec for trainer.recipe: one optimizer step = ``step_tokens`` tokens in rows of at most that."""
    return {
        "base_model": {"name": job["name"], "digest": job["digest"], "catalog_root": job["root"]},
        "train": {"path": job["train"], "sha256": job["train_sha"]},
        "validation": {"path": job["val"], "sha256": job["val_sha"]},
        "hyperparameters": {
            "epochs": job["epochs"],
            "learning_rate": LEARNING_RATE,
            "batch_size_tokens": job["step_tokens"],
            "max_seq_len": job["step_tokens"],
            "lora_r": LORA["r"],
            "lora_alpha": LORA["alpha"],
            "target_modules": LORA["target_modules"],
            "warmup_steps": WARMUP_STEPS,
            "seed": SEED,
            "gradient_checkpointing": True,
        },
        "job_dir": str(Path(job["workdir"]) / f"ours-job-{time.monotonic_ns()}"),
        "checkpoint_every_steps": 10_000_000,
    }


def step_marks(times: list[float], counts: list[int]) -> list[tuple[float, int]]:
    """(time, cumulative tokens) at the end of each step, from each step's token count."""
    marks, seen = [], 0
    for t, n in zip(times, counts, strict=True):
        seen += n
        marks.append((t, seen))
    return marks


def same_heap() -> str:
    """Give this process the heap the trainer gives itself on the CPU (``trainer.heap``: glibc's mmap
    threshold fixed at 1 MiB, set before anything is loaded). Ours always; the peer with
    ``--peer-heap same``: the fixed threshold lowers peak RSS (freed activations leave the process)
    but costs time (fresh mappings fault in again), so the peer's fastest setting is glibc's default,
    and the bench runs it that way unless asked."""
    from trainer.heap import MMAP_THRESHOLD, map_large_blocks

    return f"glibc mmap threshold {MMAP_THRESHOLD} B" if map_large_blocks() else "allocator defaults (not glibc)"


def peer_heap(job: dict[str, Any]) -> str:
    """The peer's allocator setting, as printed (``--peer-heap``)."""
    if job.get("peer_heap") == "same":
        return "glibc mmap threshold fixed at 1 MiB, as ours (trainer.heap)"
    return ("glibc defaults (dynamic mmap threshold: TRL's own setting, and faster for it here; ours runs "
            "with the threshold fixed at 1 MiB, as its jobs do on the CPU)")


def run_ours(job: dict[str, Any]) -> dict[str, Any]:
    """Train with trainer.recipe (no final save); step times from its per-step metrics, step tokens from the
    data (the lengths of the examples each planned step holds)."""
    quiet()
    same_heap()
    import torch

    torch.set_num_threads(job["threads"])
    from trainer.contract.spec import parse_spec
    from trainer.recipe import Recipe, StopFlag

    recipe = Recipe(parse_spec(our_spec(job)), 0, StopFlag())
    recipe.setup()
    recipe.train()
    metrics = recipe.progress.metrics  # per optimizer step: "elapsed_s", "loss" (and "tokens", checked below)
    counts = [sum(job["lengths"][i] for i in indices) for _, indices in recipe.steps[: len(metrics)]]
    if counts != [m["tokens"] for m in metrics]:
        raise SystemExit("ours: the recipe's per-step token counts differ from the data's")
    marks = step_marks([m["elapsed_s"] for m in metrics], counts)
    mean_loss = sum(m["loss"] for m in metrics) / len(metrics)
    result = _finish(OURS, recipe.model, job, len(metrics), marks, mean_loss)
    recipe.cleanup()
    return result


# ----------------------------------------------------------------- TRL


def trl_best_config(cuda: bool, step_tokens: int) -> dict[str, Any]:
    """SFTConfig fields of TRL's fastest documented setup for this hardware (beyond the shared ones).

    Packing with BFD makes TRL padding-free; one packed row of ``step_tokens`` per step matches our
    tokens per step. CUDA: bf16 autocast (TRL also casts the LoRA weights to bf16, its QLoRA choice).
    CPU: no bf16 (no native bf16 here); ``run_trl`` casts the LoRA weights back to fp32.
    """
    return {
        "packing": True,
        "packing_strategy": "bfd",
        "padding_free": True,
        "max_length": step_tokens,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "bf16": cuda,
        "fp16": False,
        "use_cpu": not cuda,
        "optim": "adamw_torch_fused",
    }


def trl_defaults_config(cuda: bool, step_tokens: int) -> dict[str, Any]:
    """TRL's defaults (padded batches of 8, no packing, bf16 autocast even on CPU): handicapped, not the headline."""
    return {"max_length": step_tokens, "bf16": True, "use_cpu": not cuda}


def shared_config(job: dict[str, Any]) -> dict[str, Any]:
    """SFTConfig fields both TRL configurations share with ours."""
    return {
        "assistant_only_loss": True,
        "num_train_epochs": job["epochs"],
        "learning_rate": LEARNING_RATE,
        "lr_scheduler_type": "linear",
        "warmup_steps": WARMUP_STEPS,
        **ADAM,
        "max_grad_norm": MAX_GRAD_NORM,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "seed": SEED,
        "include_num_input_tokens_seen": "non_padding",
    }


def attention_for_trl(cuda: bool) -> str:
    """TRL's own documented choice (``--attention own``): flash_attention_2 on CUDA where the flash-attn
    package is installed, else SDPA (also on CPU)."""
    import importlib.util

    return "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") is not None else "sdpa"


SAME_ATTENTION = ("the same as ours: trainer.model.attention_implementation (sft_varlen on CPU and on a GPU "
                  "without flash-attn, flash_attention_2 with it; each run prints the one it trained with)")


def describe_attention(cuda: bool, job: dict[str, Any]) -> str:
    """The peer's attention, in words (the parent never asks CUDA: bench/gpu.py's parent must not initialise it)."""
    return SAME_ATTENTION if job.get("attention", "same") == "same" else attention_for_trl(cuda)


class CountingCollator:
    """Wraps TRL's collator (it refuses a custom one with padding-free) and records, per batch, the
    tokens of the examples it was given: the data's count, whatever the pad id is."""

    def __init__(self, inner: Callable[[list[dict[str, Any]]], Any]) -> None:
        self.inner = inner
        self.counts: list[int] = []

    def __call__(self, examples: list[dict[str, Any]]) -> Any:
        self.counts.append(sum(len(e["input_ids"]) for e in examples))
        return self.inner(examples)


def _step_clock() -> tuple[Any, list[tuple[float, int]]]:
    """A TrainerCallback recording (time, real tokens seen) at the end of each optimizer step."""
    import torch
    from transformers import TrainerCallback

    marks: list[tuple[float, int]] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks.append((time.monotonic(), state.num_input_tokens_seen))

    return StepClock(), marks


def run_trl(job: dict[str, Any]) -> dict[str, Any]:
    """Train with TRL SFTTrainer in ``job["trl"]`` configuration (best or defaults); same scoring as ours."""
    quiet()
    if job.get("peer_heap") == "same":
        same_heap()
    import torch

    torch.set_num_threads(job["threads"])
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, PrinterCallback
    from trl import SFTConfig, SFTTrainer

    from trainer.model import load_base_model

    cuda, best = torch.cuda.is_available(), job["trl"] == TRL_BEST
    fields = (trl_best_config if best else trl_defaults_config)(cuda, job["step_tokens"])
    config = SFTConfig(output_dir=str(Path(job["workdir"]) / "trl-out"), save_strategy="no", eval_strategy="no",
                       report_to="none", logging_steps=10_000_000, disable_tqdm=True, **shared_config(job), **fields)
    model = load_base_model(job["model"])  # with our attention choice
    if not best or job.get("attention", "same") == "own":  # TRL's defaults pad batches: no varlen kernel serves them
        model.set_attn_implementation(attention_for_trl(cuda))
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], bias="none", task_type="CAUSAL_LM")
    rows = [json.loads(line) for line in Path(job["train"]).read_text().splitlines()]
    clock, marks = _step_clock()
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(job["model"]), peft_config=lora,
                         callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # its end-of-training dict, printed because tqdm is off
    collator = trainer.data_collator = CountingCollator(trainer.data_collator)
    assert trainer.model is not None
    as_built = dict(Counter(str(p.dtype) for p in trainer.model.parameters() if p.requires_grad))
    if best and not cuda:
        fp32_lora(trainer.model)  # TRL casts a 4-bit model's LoRA weights to bf16; the optimizer is not built yet
    output = trainer.train()
    if len(collator.counts) != output.global_step or len(marks) != output.global_step:
        raise SystemExit(f"TRL ran {output.global_step} steps from {len(collator.counts)} batches: not one a step")
    data_marks = step_marks([t for t, _ in marks], collator.counts)
    result = _finish(job["trl"], trainer.model, job, output.global_step, data_marks, output.training_loss)
    result["lora_dtypes_as_built_by_trl"] = as_built
    result["trl_own_token_count"] = marks[-1][1]  # num_input_tokens_seen "non_padding": drops tokens == pad id
    return result


def fp32_lora(model: Any) -> int:
    """Cast trainable (LoRA) parameters to fp32 in place; return how many were cast."""
    import torch

    cast = 0
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)
            cast += 1
    return cast


# ----------------------------------------------------------------- the comparison


def in_fresh_process(fn: Callable[[dict[str, Any]], dict[str, Any]], job: dict[str, Any]) -> dict[str, Any]:
    """Run ``fn(job)`` in a new spawned interpreter (clean memory peak, no warm caches)."""
    with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(fn, (job,))


def alternate(job: dict[str, Any], repeats: int, also_defaults: bool,
              run: Callable[[Callable[[dict[str, Any]], dict[str, Any]], dict[str, Any]], dict[str, Any]]
              = in_fresh_process) -> list[dict[str, Any]]:
    """Run ours, TRL-best (and TRL-defaults), ``repeats`` times, alternating; print each result as it comes."""
    results = []
    for repeat in range(1, repeats + 1):
        contenders = [(run_ours, OURS), (run_trl, TRL_BEST)] + ([(run_trl, TRL_DEFAULTS)] if also_defaults else [])
        for fn, name in contenders:
            result = {**run(fn, {**job, "trl": name}), "repeat": repeat}
            print(format_result(result), flush=True)
            results.append(result)
    return results


def format_result(r: dict[str, Any]) -> str:
    """One line per run."""
    cuda = f"  peak CUDA {r['peak_cuda_mb']:7.0f} MB" if r.get("peak_cuda_mb") is not None else ""
    return (f"#{r['repeat']} {r['name']:26s} steps {r['steps']:4d} (timed {r['timed_steps']:4d}, "
            f"{r['timed_tokens']:7d} tokens, {r['timed_s']:6.2f} s)  {r['tokens_per_s']:8.0f} tok/s  "
            f"peak RSS {r['peak_rss_mb']:6.0f} MB{cuda}  train loss {r['mean_train_loss']:.4f}  "
            f"eval loss {r['eval_loss']:.4f}  attention {r['attention']}  dropout modules active "
            f"{r['active_dropout']}  LoRA {_dtypes(r['lora_dtypes'])}"
            + (f" (TRL built {_dtypes(r['lora_dtypes_as_built_by_trl'])})" if "lora_dtypes_as_built_by_trl" in r
               else ""))


def _dtypes(counts: dict[str, int]) -> str:
    return ",".join(f"{k.removeprefix('torch.')} x{n}" for k, n in counts.items())


def medians(results: list[dict[str, Any]], memory_key: str = "peak_rss_mb") -> dict[str, dict[str, float]]:
    """Per contender: median tokens/s, memory, eval loss and mean train loss over the repeats."""
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r["name"] for r in results):
        mine = [r for r in results if r["name"] == name]
        out[name] = {k: statistics.median(r[k] for r in mine)
                     for k in ("tokens_per_s", memory_key, "eval_loss", "mean_train_loss", "steps")}
    return out


def verdict(ours: dict[str, float], peer: dict[str, float], memory_key: str = "peak_rss_mb") -> dict[str, Any]:
    """Ratios ours/peer and whether each part of the goal is met."""
    speed = ours["tokens_per_s"] / peer["tokens_per_s"]
    memory = ours[memory_key] / peer[memory_key]
    checks = {"speed": speed >= GOAL["tokens_per_s_ratio"], "memory": memory <= GOAL["memory_ratio"],
              "eval_loss": ours["eval_loss"] <= peer["eval_loss"]}
    return {"tokens_per_s_ratio": speed, "memory_ratio": memory,
            "eval_loss_ours": ours["eval_loss"], "eval_loss_peer": peer["eval_loss"], **checks,
            "goal_met": all(checks.values())}


def describe_ours(cuda: bool, step_tokens: int) -> str:
    """Our configuration, as printed at the start."""
    return (f"ours: trainer.recipe, packed rows of <= {step_tokens} tokens (padding-free, logits at trained positions "
            f"only), NF4 compute {'bf16' if cuda else 'fp32'}, AdamW(lr={LEARNING_RATE}, weight_decay=0.0), linear "
            f"schedule, warmup {WARMUP_STEPS}, max grad norm {MAX_GRAD_NORM}, non-reentrant gradient checkpointing, "
            f"LoRA r={LORA['r']} alpha={LORA['alpha']} dropout {LORA['dropout']} (the spec's default), attention "
            f"trainer.model.attention_implementation")


def describe_peer(cuda: bool, step_tokens: int, job: dict[str, Any]) -> str:
    """The peer's configuration, as printed at the start."""
    fields = {**trl_best_config(cuda, step_tokens), **shared_config(job)}
    extra = ["LoRA " + ", ".join(f"{k}={v}" for k, v in LORA.items()),
             f"attn_implementation={describe_attention(cuda, job)}",
             "LoRA weights " + ("bf16 (TRL's QLoRA cast)" if cuda else "fp32 (TRL's bf16 cast undone before train)"),
             "base: trainer.model.load_base_model (NF4, double quant, compute " + ("bf16)" if cuda else "fp32)"),
             "heap: " + peer_heap(job)]
    return "TRL-best SFTConfig(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + "); " + "; ".join(extra)


def report(job: dict[str, Any], results: list[dict[str, Any]], memory_key: str = "peak_rss_mb") -> dict[str, Any]:
    """Print medians and ratios; return the summary (the JSON line's body)."""
    med = medians(results, memory_key)
    for name, m in med.items():
        print(f"median {name:26s} {m['tokens_per_s']:8.0f} tok/s  {memory_key} {m[memory_key]:7.0f}  "
              f"eval loss {m['eval_loss']:.4f}  train loss {m['mean_train_loss']:.4f}  steps {m['steps']:.0f}")
    summary: dict[str, Any] = {"medians": med, "vs_trl_best": verdict(med[OURS], med[TRL_BEST], memory_key)}
    summary["token_count"] = token_check(job, results)
    v = summary["vs_trl_best"]
    print(f"ratio ours / TRL-best: {v['tokens_per_s_ratio']:.2f}x tokens/s, {v['memory_ratio']:.2f}x {memory_key}, "
          f"eval loss {v['eval_loss_ours']:.4f} vs {v['eval_loss_peer']:.4f} "
          f"(goal: >= {GOAL['tokens_per_s_ratio']}x tokens/s at <= {GOAL['memory_ratio']}x memory with eval loss "
          f"no worse than TRL's: {'met' if v['goal_met'] else 'NOT met'})")
    if TRL_DEFAULTS in med:
        d = summary["vs_trl_defaults_handicapped"] = verdict(med[OURS], med[TRL_DEFAULTS], memory_key)
        print(f"(handicapped peer, not the headline) ours / TRL defaults: {d['tokens_per_s_ratio']:.2f}x tokens/s, "
              f"{d['memory_ratio']:.2f}x {memory_key}")
    return summary


def token_check(job: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Print and return each contender's token total (from the data) next to the data's and TRL's own count."""
    check: dict[str, Any] = {"data": sum(job["lengths"]) * job["epochs"]}
    for name in dict.fromkeys(r["name"] for r in results):
        mine = [r for r in results if r["name"] == name]
        check[name] = sorted({r["total_tokens"] for r in mine})
        own = sorted({r["trl_own_token_count"] for r in mine if "trl_own_token_count" in r})
        if own:
            check[f"{name} own num_input_tokens_seen"] = own
    print("token count check (tokens of the examples trained on, our tokenization of the file: "
          + ", ".join(f"{k} {v}" for k, v in check.items()) + ")")
    return check


def add_counts(job: dict[str, Any], step_tokens: int = 0) -> None:
    """Put the data's token counts (``data_counts``) in ``job`` and the tokens per optimizer step
    (``step_tokens``, or 8 x the mean example length)."""
    job.update(data_counts(job))
    job["step_tokens"] = step_tokens or max(16, math.ceil(8 * sum(job["lengths"]) / len(job["lengths"])))


def main() -> None:
    """Run the alternating repeats and print per-run lines, medians, ratios and one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=600)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                        help="tiny random Llama (vocab 1,392), or SmolLM2-135M-Instruct (vocab 49,152) from its wheel")
    parser.add_argument("--step-tokens", type=int, default=0, help="tokens per optimizer step (0: 8 x mean length)")
    parser.add_argument("--attention", choices=["same", "own"], default="same",
                        help="TRL's attention: same (ours, the default: one kernel for both) or own (TRL's documented "
                             "choice: SDPA, flash-attention 2 where installed)")
    parser.add_argument("--peer-heap", choices=["default", "same"], default="default",
                        help="TRL's allocator: default (glibc's dynamic mmap threshold: TRL's own setting and its "
                             "fastest here) or same (ours: the threshold fixed at 1 MiB, trainer.heap)")
    parser.add_argument("--also-trl-defaults", action="store_true",
                        help="also run TRL with its defaults (padded, bf16 autocast on CPU), labelled handicapped")
    args = parser.parse_args()
    quiet()
    import torch

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        job = prepare(Path(tmp), args.examples, args.model)
        job.update(epochs=args.epochs, threads=args.threads, attention=args.attention, peer_heap=args.peer_heap)
        add_counts(job, args.step_tokens)
        print(f"{args.model} model, {args.examples} examples x {args.epochs} epochs, threads={args.threads}, "
              f"{args.repeats} alternating repeats, {job['step_tokens']} tokens per optimizer step for both, "
              f"{'CUDA' if cuda else 'CPU'}")
        print(describe_ours(cuda, job["step_tokens"]))
        print(describe_peer(cuda, job["step_tokens"], job), flush=True)
        results = alternate(job, args.repeats, args.also_trl_defaults)
    summary = report(job, results)
    config = {"model": args.model, "examples": args.examples, "epochs": args.epochs, "threads": args.threads,
              "repeats": args.repeats,
              "step_tokens": job["step_tokens"], "device": "cuda" if cuda else "cpu",
              "peer": {**trl_best_config(cuda, job["step_tokens"]), **shared_config(job),
                       "attn_implementation": describe_attention(cuda, job)}}
    print(json.dumps({"bench": "trainer", "config": config, "runs": results, **summary}))


if __name__ == "__main__":
    main()
