"""Throughput, peak memory and held-out preference quality: our DPO trainer vs TRL ``DPOTrainer`` at its best.

Both contenders train the same 4-bit NF4 model (``trainer.catalog.make_tiny``, loaded by
``trainer.model.load_base_model`` for both) with the same LoRA (r 8, alpha 16, all-linear),
AdamW (lr, betas, eps, weight decay 0), linear schedule (warmup 0), max grad norm 1.0, non-reentrant
gradient checkpointing, sigmoid DPO loss with the same ``beta``, seed, epochs and pairs, on the same
toy preference pairs (``trainer.toydata.toy_preferences``, OpenAI's preference format; converted for
TRL to its conversational format: prompt = input messages, chosen / rejected = the one answer each).
Both take the reference policy to be the initial model (the base: LoRA B = 0) and precompute its
log-probabilities once before training (ours in ``setup``, TRL with ``precompute_ref_log_probs``).

Dropout: what production runs. Our spec leaves ``lora_dropout`` at the job spec's default (0.05), which
a DPO job does not use (``trainer.model.add_lora(dropout=False)``: every dropout of the policy off);
TRL gets the same ``LoraConfig(lora_dropout=0.05)`` and its DPO default ``disable_dropout=True``
(``trl.trainer.utils.disable_dropout_in_model``: every ``nn.Dropout`` to p = 0, LoRA's included, as
it runs after ``get_peft_model``). The bench passes neither side an override; it reads TRL's default
from ``DPOConfig`` and prints it, and each run prints how many dropout modules were still active (0).

Attention (``--attention same``, the default): TRL 1.16 cannot train DPO padding-free, so it runs
padded batches with an attention mask, which no varlen kernel serves. On the CPU both run torch's
SDPA (ours one causal call per example, ``sft_varlen``'s CPU path; TRL one masked call per batch).
On CUDA with flash-attn both run ``flash_attention_2``; on CUDA without it ours is put on SDPA too
(our dense-mask fallback), since TRL's masked batch cannot use torch's varlen kernel. ``--attention
own`` leaves ours on its production choice. Each run prints the attention it trained with.

Pairs per optimizer step. Ours plans steps by tokens (whole pairs up to ``batch_size_tokens``), so a
step holds a variable number of pairs; TRL takes a fixed ``per_device_train_batch_size``. The bench
sets TRL's batch to ``--pairs-per-step`` (gradient accumulation 1) and our ``batch_size_tokens`` to the
smallest budget whose plan has as many steps (``step_budget``), and feeds TRL the pairs in our epoch-0
order with ``train_sampling_strategy="sequential"``: both see the same pairs in the same order, in as
many steps, the same number per step on average (where a step boundary falls differs a little). With
``--epochs`` > 1 TRL repeats that order each epoch while ours reshuffles.

The peer's best configuration (``trl_best_config``, printed at the start), from TRL's own
``DPOConfig`` / ``DPOTrainer`` source of the installed version (trl 1.16):

- ``precompute_ref_log_probs=True``, ``ref_model=None`` with ``peft_config``: the reference is the base
  with the adapter disabled, scored once before training in batches of ``precompute_ref_batch_size``
  (documented: "can be set higher than the training batch size to speed up preprocessing"). The bench
  uses 16 x the training batch: of 1x / 4x / 16x it gave TRL the fastest *training* here (median
  ~+15 % tokens/s over 1x, in either order; the reference pass itself took the same time), at ~+150 MB
  peak RSS over 1x. No reference forward per step, no second model in memory: what ours does.
- ``loss_type=["sigmoid"]``, ``beta`` as ours; ``disable_dropout`` left at TRL's default (True).
- ``padding_free`` left False: in 1.16 it "is temporarily unavailable after a refactor" (it warns and
  falls back to padding). TRL pads each batch to its longest side. ``use_logits_to_keep`` is gone: its
  fused LM head (``trl.trainer.utils.add_fused_lm_head``) never materialises the (T, V) logits; it
  projects only the labelled positions where Triton runs (CUDA, XPU), and elsewhere (this CPU) every
  position in tiles, zeroing the unlabelled ones (fixed tile shapes).
- ``max_length`` = the longest side of the data (nothing is truncated; it has no other speed effect).
- CPU: ``bf16=False`` (the model computes in fp32: NF4 compute dtype fp32, as ours) and fp32 LoRA
  weights: for a 4-bit model ``DPOTrainer`` casts the LoRA weights to bf16 unconditionally, and the
  bench casts them back before ``train()`` builds the optimizer (bf16 LoRA weights, updated in bf16,
  can lose small AdamW updates). ``bf16=True`` (autocast) was measured on this CPU, which has
  AVX512-BF16/AMX: ~18 % fewer tokens/s and ~+450 MB peak RSS (``--trl-bf16 on`` reproduces it).
  ``use_cpu=True``, ``optim="adamw_torch_fused"``, SDPA attention, dataloader in-process.
- CUDA: the same with ``bf16=True`` and bf16 LoRA weights (TRL's QLoRA choice), ``flash_attention_2``
  where the flash-attn package is installed, else SDPA (see Attention above).
- ``gradient_checkpointing=True`` (TRL's DPO default, and ours), ``use_reentrant=False``.

Fair timing: each contender runs in its own fresh spawned process; its clock starts at the end of its
first optimizer step (warm-up) and stops at the end of its last. Tokens/s = real (non-pad) tokens of
both sides of every pair in the timed steps, counted from the data with one tokenization for both
(``pair_tokens``), / timed seconds. The reference pass is timed separately (wall time of ours'
first ``reference_logps`` call, over the train pairs, and of TRL's ``_precompute_ref_logps``). Peak
memory: the process's peak RSS on CPU, ``torch.cuda.max_memory_allocated`` on CUDA. Repeats alternate
(ours, TRL, ours, TRL, ...); medians and ratios ours / TRL are reported.

Quality: every trained adapter is saved and scored afterwards, in one fresh process, by one function
(``score_adapters``): the adapter loaded on a fresh base, held-out pairs scored against the base's
log-probabilities with ``trainer.dpo`` (``eval_pair_sums`` / ``preference_metrics``): held-out DPO loss,
reward margin and reward accuracy. Mean train loss is each trainer's own (mean over steps).

    python bench/dpo.py [--pairs 800] [--epochs 1] [--repeats 3] [--threads 1] [--pairs-per-step 8]
"""

from __future__ import annotations

import argparse
import json
import math
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

from bench import trainer as bt  # noqa: E402

BETA = 0.1
# production's LoRA (dropout: the spec's default, which DPO does not use); TRL disables it by its own default
LORA: dict[str, Any] = bt.LORA
LEARNING_RATE = 2e-4  # the toy task is easy: a rate that leaves the held-out loss mid-range
VAL_PAIRS = 64
OURS, TRL_BEST = "ours", "trl-best"


# ----------------------------------------------------------------- data and model


def to_trl(row: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI preference line in TRL's conversational preference format (prompt / chosen / rejected)."""
    return {"prompt": row["input"]["messages"], "chosen": row["preferred_output"],
            "rejected": row["non_preferred_output"]}


def prepare(workdir: Path, pairs: int) -> dict[str, Any]:
    """Build and register the tiny model, write train / validation preference JSONL; return the job fields."""
    from trainer.catalog import make_tiny
    from trainer.data import sha256_file
    from trainer.toydata import toy_preferences, write_jsonl

    job: dict[str, Any] = {"workdir": str(workdir)}
    job.update(bt.register(make_tiny(workdir / "tiny"), "tiny", workdir))
    train = write_jsonl(workdir / "train.jsonl", toy_preferences(pairs, seed=21))
    val = write_jsonl(workdir / "val.jsonl", toy_preferences(VAL_PAIRS, seed=22))
    job.update(train=str(train), train_sha=sha256_file(train), val=str(val), val_sha=sha256_file(val))
    return job


def tokenized_pairs(job: dict[str, Any], path_key: str = "train") -> list[Any]:
    """Our tokenization (``trainer.dpo.tokenize_pairs``) of the train or validation pairs."""
    from transformers import AutoTokenizer

    from trainer.dpo import read_pairs, tokenize_pairs

    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    what = "train" if path_key == "train" else "validation"
    return tokenize_pairs(tokenizer, read_pairs(job[path_key], what), 1 << 20, what)


def pair_tokens(job: dict[str, Any]) -> list[int]:
    """Real tokens of each train pair, both sides (prompt + chosen, prompt + rejected): the count for both."""
    return [len(p) for p in tokenized_pairs(job)]


def longest_side(job: dict[str, Any]) -> int:
    """The longest side (prompt + answer) over the train and validation pairs."""
    return max(max(len(p.chosen), len(p.rejected)) for key in ("train", "val") for p in tokenized_pairs(job, key))


def trl_batches(order: list[int], per_step: int, epochs: int) -> list[list[int]]:
    """TRL's steps under the sequential sampler: consecutive ``per_step`` pairs of ``order``, every epoch."""
    steps = [order[i : i + per_step] for i in range(0, len(order), per_step)]
    return steps * epochs


def step_budget(tokens: list[int], per_step: int, epochs: int, longest: int) -> int:
    """Our ``batch_size_tokens``: the smallest budget >= ``per_step`` x the mean pair length whose plan has
    as many steps as TRL's (``ceil(pairs / per_step)`` per epoch), so both average ``per_step`` pairs a step."""
    from trainer.packing import plan

    budget = max(2 * longest, math.ceil(per_step * sum(tokens) / len(tokens)))
    budget += budget % 2  # even: max_seq_len = budget / 2 makes one row per step
    target = math.ceil(len(tokens) / per_step) * epochs
    while sum(len(steps) for steps in plan(tokens, budget, bt.SEED, epochs)) > target:
        budget += 2
    return budget


def marks_from(times: list[float], steps: list[list[int]], tokens: list[int]) -> list[tuple[float, int]]:
    """(time, cumulative data tokens) at the end of each step, from the pairs each step held."""
    marks, seen = [], 0
    for t, step in zip(times, steps, strict=True):
        seen += sum(tokens[i] for i in step)
        marks.append((t, seen))
    return marks


def save_adapter(model: Any, job: dict[str, Any], name: str) -> str:
    """Save the trainable (LoRA) tensors, fp32, for the shared scoring; return the path."""
    import torch
    from safetensors.torch import save_file

    from trainer.model import trainable_state

    path = Path(job["workdir"]) / "adapters" / f"{name}-{time.monotonic_ns()}.safetensors"
    path.parent.mkdir(exist_ok=True)
    save_file({k: v.to(torch.float32) for k, v in trainable_state(model).items()}, str(path))
    return str(path)


def _result(name: str, model: Any, job: dict[str, Any], marks: list[tuple[float, int]], mean_loss: float,
            ref_s: float | None) -> dict[str, Any]:
    result: dict[str, Any] = {"name": name, "steps": len(marks), **bt._timed(marks), "mean_train_loss": mean_loss,
                              "ref_pass_s": ref_s, "peak_rss_mb": bt._peak_rss_mb(), "peak_cuda_mb": bt._peak_cuda_mb()}
    result["lora_dtypes"] = dict(Counter(str(p.dtype) for p in model.parameters() if p.requires_grad))
    result["attention"] = str(model.config._attn_implementation)
    result["active_dropout"] = bt.active_dropout(model)
    result["adapter"] = save_adapter(model, job, name)
    return result


# ----------------------------------------------------------------- ours


def our_spec(job: dict[str, Any]) -> dict[str, Any]:
    """bench/trainer.py's spec with ``method: dpo``, ``beta`` and one packed row per step; no dropout
    override (what a production DPO job runs: the spec refuses a non-zero explicit lora_dropout)."""
    spec = bt.our_spec(job)
    spec["method"] = "dpo"
    hp = spec["hyperparameters"]
    hp.update(beta=BETA, learning_rate=job["lr"],
              max_seq_len=job["step_tokens"] // 2)  # a row holds <= 2 * max_seq_len tokens: the whole step
    return spec


def run_ours(job: dict[str, Any]) -> dict[str, Any]:
    """Train with trainer.recipe (method dpo, no final save); step times from its per-step metrics."""
    bt.quiet()
    bt.same_heap()
    import torch

    torch.set_num_threads(job["threads"])
    import trainer.dpo
    import trainer.model
    import trainer.recipe
    from trainer.contract.spec import parse_spec
    from trainer.recipe import Recipe, StopFlag

    if ours_on_sdpa(torch.cuda.is_available(), job):  # TRL's padded batches get no varlen kernel: one kernel for both
        trainer.model.attention_implementation = lambda device, max_seq_len: "sdpa"

    ref_s = _time_calls([trainer.dpo, trainer.recipe], "reference_logps")
    recipe = Recipe(parse_spec(our_spec(job)), 0, StopFlag())
    recipe.setup()
    recipe.train()
    metrics = recipe.progress.metrics  # per optimizer step: "tokens", "elapsed_s", "loss"
    steps = [indices for _, indices in recipe.steps][: len(metrics)]
    marks = marks_from([m["elapsed_s"] for m in metrics], steps, job["pair_tokens"])
    if [m["tokens"] for m in metrics] != [sum(job["pair_tokens"][i] for i in s) for s in steps]:
        raise SystemExit("ours: the recipe's per-step token counts differ from the data's")
    mean_loss = sum(m["loss"] for m in metrics) / len(metrics)
    result = _result(OURS, recipe.model, job, marks, mean_loss, ref_s[0] if ref_s else None)  # [1]: validation
    result["order_matches_trl"] = [i for s in steps for i in s][: len(job["order"])] == job["order"]
    result["pairs_per_step"] = statistics.mean(len(s) for s in steps)
    recipe.cleanup()
    return result


def _time_calls(modules: list[Any], name: str) -> list[float]:
    """Wrap ``module.name`` in each module (the same function) so every call's wall time is recorded."""
    spent: list[float] = []
    original = next(getattr(m, name) for m in modules if hasattr(m, name))

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.monotonic() - t0)

    for module in modules:
        if getattr(module, name, None) is original:
            setattr(module, name, timed)
    return spent


# ----------------------------------------------------------------- TRL


def ours_on_sdpa(cuda: bool, job: dict[str, Any]) -> bool:
    """``--attention same`` on CUDA without flash-attn: ours on SDPA too (see the module docstring)."""
    return cuda and job.get("attention", "same") == "same" and bt.attention_for_trl(cuda) == "sdpa"


def describe_attention(cuda: bool, job: dict[str, Any]) -> str:
    """Both contenders' attention, in words."""
    if not cuda:
        return ("torch SDPA for both (ours: sft_varlen's CPU path, one causal call per example; TRL: sdpa, one masked "
                "call per padded batch)")
    if bt.attention_for_trl(cuda) == "flash_attention_2":
        return "flash_attention_2 for both"
    if ours_on_sdpa(cuda, job):
        return "sdpa for both (ours put on its dense-mask fallback: TRL's padded batches get no varlen kernel)"
    return "ours: its production choice (varlen kernel); TRL: sdpa with a padding mask"


def trl_dropout_default() -> bool:
    """TRL's own ``DPOConfig.disable_dropout`` default (the bench does not set it)."""
    import dataclasses

    from trl import DPOConfig

    return bool(next(f.default for f in dataclasses.fields(DPOConfig) if f.name == "disable_dropout"))


def trl_best_config(cuda: bool, job: dict[str, Any]) -> dict[str, Any]:
    """DPOConfig fields of TRL's fastest documented setup for this hardware (see the module docstring)."""
    per_step = job["pairs_per_step"]
    bf16 = cuda if job.get("trl_bf16", "auto") == "auto" else job["trl_bf16"] == "on"
    return {
        "precompute_ref_log_probs": True,
        "precompute_ref_batch_size": 16 * per_step,
        "loss_type": ["sigmoid"],
        "beta": BETA,
        "padding_free": False,  # trl 1.16: "temporarily unavailable", falls back to padding
        "max_length": job["longest_side"],
        "per_device_train_batch_size": per_step,
        "gradient_accumulation_steps": 1,
        "train_sampling_strategy": "sequential",  # the pairs are given in our epoch-0 order
        "bf16": bf16,
        "fp16": False,
        "use_cpu": not cuda,
        "optim": "adamw_torch_fused",
        "dataloader_num_workers": 0,
    }


def shared_config(job: dict[str, Any]) -> dict[str, Any]:
    """DPOConfig fields that are ours too (bench/trainer.py's, less the SFT-only ones)."""
    shared = {k: v for k, v in bt.shared_config(job).items() if k != "assistant_only_loss"}
    shared["learning_rate"] = job["lr"]
    shared["gradient_checkpointing"] = job["gradient_checkpointing"]
    return shared


def run_trl(job: dict[str, Any]) -> dict[str, Any]:
    """Train with TRL DPOTrainer in its best configuration; the reference pass timed apart."""
    bt.quiet()
    if job.get("peer_heap") == "same":
        bt.same_heap()
    import torch

    torch.set_num_threads(job["threads"])
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, PrinterCallback
    from trl import DPOConfig, DPOTrainer

    from trainer.model import load_base_model

    cuda = torch.cuda.is_available()
    ref_s: list[float] = []

    class TimedDPOTrainer(DPOTrainer):  # only times the reference pass; changes nothing
        def _precompute_ref_logps(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return super()._precompute_ref_logps(*args, **kwargs)
            finally:
                ref_s.append(time.monotonic() - t0)

    fields = trl_best_config(cuda, job)
    config = DPOConfig(output_dir=str(Path(job["workdir"]) / "trl-out"), save_strategy="no", eval_strategy="no",
                       report_to="none", logging_steps=10_000_000, disable_tqdm=True, **shared_config(job), **fields)
    model = load_base_model(job["model"])
    model.set_attn_implementation(bt.attention_for_trl(cuda))
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], bias="none", task_type="CAUSAL_LM")
    lines = Path(job["train"]).read_text().splitlines()
    rows = [to_trl(json.loads(lines[i])) for i in job["order"]]
    clock, clock_marks = bt._step_clock()
    trainer = TimedDPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                              processing_class=AutoTokenizer.from_pretrained(job["model"]), peft_config=lora,
                              callbacks=[clock])
    trainer.remove_callback(PrinterCallback)
    assert trainer.model is not None
    as_built = dict(Counter(str(p.dtype) for p in trainer.model.parameters() if p.requires_grad))
    if not fields["bf16"]:
        bt.fp32_lora(trainer.model)  # undo TRL's bf16 cast of a 4-bit model's LoRA; the optimizer is not built yet
    output = trainer.train()
    n = len(job["order"])
    steps = trl_batches(job["order"], fields["per_device_train_batch_size"], job["epochs"])
    if len(steps) != output.global_step or len(clock_marks) != len(steps):
        raise SystemExit(f"TRL ran {output.global_step} steps, the bench expected {len(steps)}")
    marks = marks_from([t for t, _ in clock_marks], steps, job["pair_tokens"])
    result = _result(TRL_BEST, trainer.model, job, marks, output.training_loss, ref_s[0] if ref_s else None)
    result["lora_dtypes_as_built_by_trl"] = as_built
    result["trl_own_token_count"] = clock_marks[-1][1]  # TRL's non-pad count: equal to the data's when tokenized alike
    result["pairs_per_step"] = n * job["epochs"] / len(steps)
    return result


# ----------------------------------------------------------------- shared scoring


def score_adapters(job: dict[str, Any]) -> dict[str, Any]:
    """The one scoring function: each saved adapter on a fresh base, held-out pairs against the base.

    Returns ``{"reference": metrics of the base itself, path: metrics}`` with ``trainer.dpo``'s
    ``preference_metrics`` (DPO loss, reward margin, reward accuracy, ...)."""
    bt.quiet()
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(job["threads"])
    from trainer.contract.spec import parse_spec
    from trainer.dpo import eval_pair_sums, pair_rows, preference_metrics, reference_logps
    from trainer.model import add_lora, load_base_model

    pairs = tokenized_pairs(job, "val")
    capacity = job["step_tokens"]
    rows = pair_rows(pairs, list(range(len(pairs))), capacity)
    model = add_lora(load_base_model(job["model"]), parse_spec(our_spec(job)).hyperparameters)
    reference = reference_logps(model, rows, len(pairs))  # LoRA B = 0: the base
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out: dict[str, Any] = {"reference": preference_metrics(eval_pair_sums(model, rows, reference, BETA))}
    for path in job["adapters"]:
        tensors = load_file(path)
        if set(tensors) != set(params):
            raise SystemExit(f"{path}: LoRA tensor names differ from the scorer's ({len(tensors)} vs {len(params)})")
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value.to(params[name].dtype))
        out[path] = preference_metrics(eval_pair_sums(model, rows, reference, BETA))
    return out


# ----------------------------------------------------------------- the comparison


def alternate(job: dict[str, Any], repeats: int, contenders: list[str],
              run: Callable[[Callable[[dict[str, Any]], dict[str, Any]], dict[str, Any]], dict[str, Any]]
              = bt.in_fresh_process) -> list[dict[str, Any]]:
    """Run the contenders ``repeats`` times, alternating; print each run as it ends."""
    fns = {OURS: run_ours, TRL_BEST: run_trl}
    results = []
    for repeat in range(1, repeats + 1):
        for name in contenders:
            result = {**run(fns[name], job), "repeat": repeat}
            print(format_run(result), flush=True)
            results.append(result)
    return results


def format_run(r: dict[str, Any]) -> str:
    """One line per run (training only; quality comes after the shared scoring)."""
    cuda = f"  peak CUDA {r['peak_cuda_mb']:6.0f} MB" if r.get("peak_cuda_mb") is not None else ""
    ref = f"{r['ref_pass_s']:.2f} s" if r.get("ref_pass_s") is not None else "n/a"
    built = r.get("lora_dtypes_as_built_by_trl")
    return (f"#{r['repeat']} {r['name']:9s} steps {r['steps']:4d} ({r['pairs_per_step']:.2f} pairs/step; timed "
            f"{r['timed_steps']:4d}, {r['timed_tokens']:7d} tokens, {r['timed_s']:6.2f} s) "
            f"{r['tokens_per_s']:7.0f} tok/s  ref pass {ref}  peak RSS {r['peak_rss_mb']:5.0f} MB{cuda}  "
            f"train loss {r['mean_train_loss']:.4f}  attention {r['attention']}  dropout modules active "
            f"{r['active_dropout']}  LoRA {bt._dtypes(r['lora_dtypes'])}"
            + (f" (TRL built {bt._dtypes(built)})" if built else "")
            + ("" if r.get("order_matches_trl", True) else "  (WARNING: pair order differs from TRL's)"))


KEYS = ("tokens_per_s", "ref_pass_s", "memory_mb", "heldout_loss", "reward_margin", "reward_accuracy",
        "mean_train_loss", "steps")


def medians(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per contender: the median of each reported number over the repeats."""
    out: dict[str, dict[str, float | None]] = {}
    for name in dict.fromkeys(r["name"] for r in results):
        mine = [r for r in results if r["name"] == name]
        out[name] = {k: (statistics.median(r[k] for r in mine) if all(r.get(k) is not None for r in mine) else None)
                     for k in KEYS}
    return out


def _ratio(ours: float | None, peer: float | None) -> float | None:
    return ours / peer if ours is not None and peer else None


def table(med: dict[str, dict[str, float | None]], memory: str) -> str:
    """The medians (and ratios ours / TRL when both ran) as a Markdown table."""
    def cell(v: float | None, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    fmts = {"tokens_per_s": ",.0f", "ref_pass_s": ".2f", "memory_mb": ",.0f", "heldout_loss": ".4f",
            "reward_margin": ".4f", "reward_accuracy": ".3f", "mean_train_loss": ".4f", "steps": ".0f"}
    heads = ["tokens/s", "ref pass s", f"peak {memory} MB", "held-out DPO loss", "reward margin", "reward acc",
             "mean train loss", "steps"]
    lines = ["| contender | " + " | ".join(heads) + " |", "| --- |" + " --- |" * len(heads)]
    for name, m in med.items():
        lines.append(f"| {name} | " + " | ".join(cell(m[k], fmts[k]) for k in KEYS) + " |")
    if OURS in med and TRL_BEST in med:
        ratio = {k: _ratio(med[OURS][k], med[TRL_BEST][k]) for k in ("tokens_per_s", "ref_pass_s", "memory_mb")}
        lines.append("| ratio ours / TRL | " + " | ".join(
            cell(ratio.get(k), ".2f") + ("x" if ratio.get(k) is not None else "") if k in ratio else ""
            for k in KEYS) + " |")
    return "\n".join(lines)


def verdict(med: dict[str, dict[str, float | None]]) -> dict[str, Any]:
    """Print and return ours / TRL against the goal (bench/trainer.py's ``GOAL``), when both ran."""
    if OURS not in med or TRL_BEST not in med:
        return {}
    ours, peer = med[OURS], med[TRL_BEST]
    assert ours["tokens_per_s"] and peer["tokens_per_s"] and ours["memory_mb"] and peer["memory_mb"]
    assert ours["heldout_loss"] is not None and peer["heldout_loss"] is not None
    v: dict[str, Any] = {"tokens_per_s_ratio": ours["tokens_per_s"] / peer["tokens_per_s"],
                         "memory_ratio": ours["memory_mb"] / peer["memory_mb"],
                         "heldout_loss_ours": ours["heldout_loss"], "heldout_loss_peer": peer["heldout_loss"]}
    v.update(speed=v["tokens_per_s_ratio"] >= bt.GOAL["tokens_per_s_ratio"],
             memory=v["memory_ratio"] <= bt.GOAL["memory_ratio"],
             eval_loss=v["heldout_loss_ours"] <= v["heldout_loss_peer"])
    v["goal_met"] = v["speed"] and v["memory"] and v["eval_loss"]
    print(f"ratio ours / TRL-best: {v['tokens_per_s_ratio']:.2f}x tokens/s, {v['memory_ratio']:.2f}x memory, "
          f"held-out DPO loss {v['heldout_loss_ours']:.4f} vs {v['heldout_loss_peer']:.4f} (goal: >= "
          f"{bt.GOAL['tokens_per_s_ratio']}x at <= {bt.GOAL['memory_ratio']}x, loss no worse: "
          f"{'met' if v['goal_met'] else 'NOT met'})")
    return {"vs_trl_best": v}


def describe(cuda: bool, job: dict[str, Any]) -> list[str]:
    """Both configurations, as printed at the start."""
    ours = (f"ours: trainer.recipe method dpo, beta {BETA}, batch_size_tokens {job['step_tokens']} (whole pairs, "
            f"one packed row per step: chosen then rejected, no padding, logits at trained positions only), "
            f"reference log-probs precomputed in setup, NF4 compute {'bf16' if cuda else 'fp32'}, "
            f"AdamW(lr={job['lr']}, weight_decay=0.0), linear schedule, warmup {bt.WARMUP_STEPS}, max grad norm "
            f"{bt.MAX_GRAD_NORM}, gradient checkpointing {job['gradient_checkpointing']}, LoRA r={LORA['r']} "
            f"alpha={LORA['alpha']}, lora_dropout the spec's default ({LORA['dropout']}, unused by DPO: "
            f"add_lora(dropout=False))")
    fields = {**trl_best_config(cuda, job), **shared_config(job)}
    bf16 = fields["bf16"]
    peer = ("TRL-best DPOConfig(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + "); ref_model=None + "
            "peft_config (reference = adapter disabled); LoRA " + ", ".join(f"{k}={v}" for k, v in LORA.items())
            + f"; disable_dropout={trl_dropout_default()} (TRL's DPOConfig default, not set by the bench)"
            + f"; attention: {describe_attention(cuda, job)}; LoRA weights "
            + ("bf16 (TRL's QLoRA cast)" if bf16 else "fp32 (TRL's bf16 cast undone before train)")
            + "; base: trainer.model.load_base_model (NF4, double quant, compute " + ("bf16)" if cuda else "fp32)"))
    return [ours, peer]


def main() -> None:
    """Alternating repeats, then the shared scoring; print runs, the table of medians and ratios, one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=800, help="training pairs (default 800)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats per contender (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per contender (default 1)")
    parser.add_argument("--pairs-per-step", type=int, default=8,
                        help="TRL's batch; ours' batch_size_tokens: the budget giving as many steps (default 8)")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE, help=f"learning rate (default {LEARNING_RATE})")
    parser.add_argument("--no-gradient-checkpointing", action="store_true", help="turn it off for both")
    parser.add_argument("--trl-bf16", choices=["auto", "on", "off"], default="auto",
                        help="TRL's bf16 autocast (auto: on CUDA only; on the CPU it measured slower)")
    parser.add_argument("--attention", choices=["same", "own"], default="same",
                        help="same: one kernel for both (default); own: ours on its production choice")
    parser.add_argument("--peer-heap", choices=["default", "same"], default="default",
                        help="TRL's allocator: default (glibc's: its fastest) or same (ours: mmap threshold 1 MiB)")
    parser.add_argument("--only", choices=[OURS, "trl"], help="run one contender (no ratios)")
    args = parser.parse_args()
    bt.quiet()
    import torch

    from trainer.packing import epoch_order

    cuda = torch.cuda.is_available()
    contenders = {None: [OURS, TRL_BEST], OURS: [OURS], "trl": [TRL_BEST]}[args.only]
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        job = prepare(Path(tmp), args.pairs)
        job.update(epochs=args.epochs, threads=args.threads, lr=args.lr, pairs_per_step=args.pairs_per_step,
                   gradient_checkpointing=not args.no_gradient_checkpointing, trl_bf16=args.trl_bf16,
                   attention=args.attention, peer_heap=args.peer_heap)
        job["pair_tokens"] = pair_tokens(job)
        job["longest_side"] = longest_side(job)
        job["step_tokens"] = step_budget(job["pair_tokens"], args.pairs_per_step, args.epochs, job["longest_side"])
        job["order"] = epoch_order(args.pairs, bt.SEED, 0)
        print(f"tiny model, {args.pairs} pairs x {args.epochs} epochs ({sum(job['pair_tokens'])} tokens per epoch, "
              f"both sides), {VAL_PAIRS} held-out pairs, threads={args.threads}, {args.repeats} alternating repeats, "
              f"{args.pairs_per_step} pairs per step (ours: {job['step_tokens']} tokens per step), "
              f"{'CUDA' if cuda else 'CPU'}")
        for line in describe(cuda, job):
            print(line, flush=True)
        print("peer heap: " + bt.peer_heap(job), flush=True)
        results = alternate(job, args.repeats, contenders)
        scores = bt.in_fresh_process(score_adapters, {**job, "adapters": [r["adapter"] for r in results]})
    memory = "cuda" if cuda else "rss"
    for r in results:
        q = scores[r["adapter"]]
        r.update(heldout=q, heldout_loss=q["loss"], reward_margin=q["reward_margin"],
                 reward_accuracy=q["reward_accuracy"], memory_mb=r["peak_cuda_mb"] if cuda else r["peak_rss_mb"])
        r.pop("adapter")
    base = scores["reference"]
    print(f"held-out reference (the base): DPO loss {base['loss']:.4f}, reward accuracy {base['reward_accuracy']:.3f}")
    for r in results:
        print(f"#{r['repeat']} {r['name']:9s} held-out DPO loss {r['heldout_loss']:.4f}  margin "
              f"{r['reward_margin']:.4f}  reward accuracy {r['reward_accuracy']:.3f}")
    med = medians(results)
    print(table(med, memory))
    summary = verdict(med)
    trl_counts = {r["trl_own_token_count"] for r in results if r["name"] == TRL_BEST}
    total = sum(job["pair_tokens"]) * args.epochs
    if trl_counts:
        print(f"token count check: data {total}, TRL's own non-pad count {sorted(trl_counts)}")
    config = {"pairs": args.pairs, "epochs": args.epochs, "lr": args.lr, "threads": args.threads,
              "repeats": args.repeats,
              "pairs_per_step": args.pairs_per_step, "step_tokens": job["step_tokens"],
              "device": "cuda" if cuda else "cpu", "peer": {**trl_best_config(cuda, job), **shared_config(job),
                                                            "attention": describe_attention(cuda, job)}}
    print(json.dumps({"bench": "dpo", "config": config, "reference": base, "runs": results, "medians": med,
                      **summary}))


if __name__ == "__main__":
    main()
