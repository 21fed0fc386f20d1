"""The QLoRA recipe that runs inside one Slurm job. Read it top to bottom.

``run_job(spec)`` = ``setup`` (verify inputs, tokenize, load the pinned 4-bit
base, add LoRA, resume from the newest complete checkpoint) -> ``train``
(packed steps, periodic checkpoints and evals, signal flags checked after
every optimizer step) -> ``finalize`` (adapter, eval, metrics, manifest into
``attempts/<n>/staging``, ``COMPLETE`` last) -> ``cleanup``.

Signals: SIGUSR1 -> finish the step, checkpoint, exit 75 (requeue);
SIGTERM -> finish the step, checkpoint, exit 143, never COMPLETE.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from trainer import checkpoint as ckpt
from trainer import exitcodes
from trainer.catalog import resolve
from trainer.data import holdout_split, read_conversations, tokenize_all, verify_sha256
from trainer.errors import CheckpointError, DatasetError, ModelDigestError, TrainerError
from trainer.events import EventLog
from trainer.packing import IGNORE, Example, Row, build_row, pack, plan
from trainer.spec import Hyperparameters, JobSpec, spec_hash, spec_to_json

if TYPE_CHECKING:
    import torch

log = logging.getLogger("trainer")

STAGING_FILES = ("adapter_model.safetensors", "adapter_config.json", "eval.json", "metrics.jsonl")


# ----------------------------------------------------------------- signals


class Stop(Exception):
    """Raised at a safe point after SIGUSR1 / SIGTERM; carries the exit code."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = exitcodes.CANCELLED if signum == signal.SIGTERM else exitcodes.REQUEUE


class StopFlag:
    """Signal handlers only set this flag; the recipe polls it at safe points."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None

    def install(self) -> None:
        """Route SIGUSR1 and SIGTERM to the flag."""
        signal.signal(signal.SIGUSR1, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum != signal.SIGTERM:  # cancel wins over requeue
            self.signum = signum
            self.received_at = time.monotonic()

    def check(self) -> None:
        """Raise :class:`Stop` when a signal arrived."""
        if self.signum is not None:
            raise Stop(self.signum)


# ----------------------------------------------------------------- model pieces


def load_base_model(path: str | Path) -> Any:
    """Load a base model in 4-bit NF4 (double quant) on CUDA when present, else CPU.

    Applies the bitsandbytes AVX512-BF16 workaround (see ``disable_cpu_repack``).
    """
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cuda = torch.cuda.is_available()
    compute = torch.bfloat16 if cuda else torch.float32
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=compute, device_map={"": 0} if cuda else "cpu"
    )
    disable_cpu_repack(model)
    return model


def disable_cpu_repack(model: Any) -> int:
    """Stop bnb from repacking 4-bit weights for inference on AVX512-BF16 CPUs.

    bnb 0.49-0.50 repacks a ``Linear4bit`` the first time it runs in eval mode
    without grad and never undoes it; LoRA gradients are silently wrong after
    any eval pass. Returns the number of layers patched.
    """
    import bitsandbytes as bnb

    patched = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            patched += 1
    return patched


def add_lora(model: Any, hp: Hyperparameters) -> Any:
    """Prepare a k-bit model for training and wrap it with LoRA (seeded init)."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=hp.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    torch.manual_seed(hp.seed)
    config = LoraConfig(
        r=hp.lora_r,
        lora_alpha=hp.lora_alpha,
        lora_dropout=hp.lora_dropout,
        target_modules=hp.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def row_loss(model: Any, row: Row) -> tuple[torch.Tensor, int, int]:
    """Forward one packed row; return (summed loss, trained tokens, correct argmax).

    No attention mask and no cache: with per-example ``position_ids`` that makes
    transformers use a block-diagonal causal mask. Logits are computed only at
    trained positions (``logits_to_keep``).
    """
    import torch
    import torch.nn.functional as F

    device = next(p.device for p in model.parameters())
    keep = [i for i, t in enumerate(row.targets) if t != IGNORE]
    ids = torch.tensor([row.input_ids], device=device)
    positions = torch.tensor([row.position_ids], device=device)
    keep_t = torch.tensor(keep, device=device)
    targets = torch.tensor([row.targets[i] for i in keep], device=device)
    out = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep_t)
    logits = out.logits[0].float()
    loss = F.cross_entropy(logits, targets, reduction="sum")
    correct = int((logits.detach().argmax(-1) == targets).sum())
    return loss, len(keep), correct


def evaluate(model: Any, examples: list[Example], capacity: int, stop: StopFlag | None = None) -> dict[str, float]:
    """Token-weighted loss, perplexity and token accuracy over ``examples``."""
    import torch

    rows = pack([len(e) for e in examples], list(range(len(examples))), capacity)
    total, tokens, correct = 0.0, 0, 0
    model.eval()
    try:
        with torch.no_grad():
            for indices in rows:
                if stop is not None:
                    stop.check()
                loss, n, ok = row_loss(model, build_row([examples[i] for i in indices]))
                total, tokens, correct = total + float(loss), tokens + n, correct + ok
    finally:
        model.train()
    mean = total / max(tokens, 1)
    return {
        "loss": mean,
        "perplexity": math.exp(min(mean, 50.0)),
        "token_accuracy": correct / max(tokens, 1),
        "tokens": tokens,
        "examples": len(examples),
    }


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """Return the trainable (LoRA) parameters by name, detached on CPU."""
    return {
        n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad
    }


def lr_lambda(warmup: int, total: int) -> Any:
    """Linear warmup over ``warmup`` steps, then linear decay to 0 at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


# ----------------------------------------------------------------- the recipe


@dataclass
class Progress:
    """Everything besides tensors that a checkpoint restores."""

    step: int = 0
    elapsed_s: float = 0.0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)


class Recipe:
    """One attempt of one job; ``run_job`` calls its phases in order."""

    def __init__(self, spec: JobSpec, attempt: int, stop: StopFlag) -> None:
        self.spec = spec
        self.hp = spec.hyperparameters
        self.attempt = attempt
        self.stop = stop
        self.spec_hash = spec_hash(spec)
        self.job_dir = Path(spec.job_dir)
        self.checkpoints = self.job_dir / "checkpoints"
        self.staging = self.job_dir / "attempts" / str(attempt) / "staging"
        self.job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.checkpoints.mkdir(mode=0o700, exist_ok=True)
        self.events = EventLog(self.job_dir / "events.jsonl", attempt, spec.job_id)
        self.progress = Progress()
        self.last_checkpoint_step = -1

    # -- setup ---------------------------------------------------------------

    def verify_inputs(self) -> Path:
        """Check dataset sha256s and the base-model digest before any heavy work."""
        verify_sha256(self.spec.train.path, self.spec.train.sha256, "train")
        if self.spec.validation is not None:
            verify_sha256(self.spec.validation.path, self.spec.validation.sha256, "validation")
        ref = self.spec.base_model
        return resolve(ref.catalog_root, ref.name, ref.digest)

    def setup(self) -> None:
        """Verify inputs, tokenize, load the model, build optimizer, resume."""
        self.events.emit("start", spec_hash=self.spec_hash)
        model_path = self.verify_inputs()
        self.stop.check()
        self.events.phase("tokenizing")
        import torch
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.train_examples, self.val_examples = self._load_examples()
        self.stop.check()
        self.rows = [
            (epoch, row)
            for epoch, rows in enumerate(
                plan([len(e) for e in self.train_examples], self.hp.batch_size_tokens,
                     self.hp.seed, self.hp.epochs)
            )
            for row in rows
        ]
        self.total_steps = min(len(self.rows), self.hp.max_steps or len(self.rows))
        log.info(
            "tokenized %d train / %d validation examples, %d steps",
            len(self.train_examples), len(self.val_examples), self.total_steps,
        )
        self.model = add_lora(load_base_model(model_path), self.hp)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.hp.learning_rate, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.hp.warmup_steps, self.total_steps)
        )
        random.seed(self.hp.seed)
        self.resume()

    def _load_examples(self) -> tuple[list[Example], list[Example]]:
        max_len = self.hp.max_seq_len
        train = tokenize_all(
            self.tokenizer, read_conversations(self.spec.train.path, "train"), max_len, "train"
        )
        if self.spec.validation is not None:
            conversations = read_conversations(self.spec.validation.path, "validation")
            return train, tokenize_all(self.tokenizer, conversations, max_len, "validation")
        keep, held = holdout_split(len(train), self.spec.validation_split, self.hp.seed)
        return [train[i] for i in keep], [train[i] for i in held]

    def resume(self) -> None:
        """Load the newest complete checkpoint of this job, if any (exact resume)."""
        import torch
        from safetensors.torch import load as load_safetensors

        removed = ckpt.clean_leftovers(self.checkpoints)
        if removed:
            log.info("removed %d incomplete checkpoint entries", len(removed))
        for step in reversed(ckpt.complete_steps(self.checkpoints)):
            path = ckpt.step_dir(self.checkpoints, step)
            try:
                state = json.loads((path / "progress.json").read_text())
                if state["spec_hash"] != self.spec_hash:
                    raise CheckpointError(
                        f"checkpoint {path.name} was written for another spec "
                        f"({state['spec_hash']}); refusing to mix jobs"
                    )
                adapter = load_safetensors((path / "adapter.safetensors").read_bytes())
                tensors = torch.load(path / "state.pt", weights_only=True, map_location="cpu")
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                log.warning("checkpoint %s unreadable (%s); trying an older one", path.name, type(e).__name__)
                continue
            named = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in adapter.items():
                    named[name].copy_(value)
            self.optimizer.load_state_dict(tensors["optimizer"])
            self.scheduler.load_state_dict(tensors["scheduler"])
            torch.set_rng_state(tensors["rng_cpu"])
            if torch.cuda.is_available() and "rng_cuda" in tensors:
                torch.cuda.set_rng_state_all(tensors["rng_cuda"])
            random.setstate(_tuples(state["rng_python"]))
            self.progress = Progress(
                state["step"], state["elapsed_s"], state["metrics"], state["evals"]
            )
            self.last_checkpoint_step = step
            log.info("resumed from checkpoint step %d", step)
            self.events.emit("start", resumed_from_step=step)
            return

    # -- train ---------------------------------------------------------------

    def train(self) -> None:
        """Run the optimizer steps left; checkpoint, eval and honour signals."""
        progress, hp = self.progress, self.hp
        if progress.step == 0 and not progress.evals:
            self._eval("before")
        self.events.phase("training")
        self.model.train()
        started = time.monotonic() - progress.elapsed_s
        while progress.step < self.total_steps:
            epoch, indices = self.rows[progress.step]
            row = build_row([self.train_examples[i] for i in indices])
            t0 = time.monotonic()
            loss_sum, n, _ = row_loss(self.model, row)
            loss = loss_sum / max(n, 1)
            loss.backward()
            import torch

            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            dt = time.monotonic() - t0
            progress.elapsed_s = time.monotonic() - started
            metric = {
                "step": progress.step, "epoch": epoch, "loss": float(loss.detach()), "lr": lr,
                "tokens": len(row.input_ids), "trained_tokens": n,
                "tokens_per_s": len(row.input_ids) / dt if dt > 0 else None,
                "elapsed_s": round(progress.elapsed_s, 4),
            }
            progress.metrics.append(metric)
            self.events.emit("metrics", total_steps=self.total_steps, **metric)
            if hp.eval_every_steps and progress.step % hp.eval_every_steps == 0:
                self._eval("step")
            if self.stop.signum is not None:
                raise Stop(self.stop.signum)
            if progress.step % self.spec.checkpoint_every_steps == 0:
                self.save_checkpoint()

    def _eval(self, when: str) -> dict[str, Any]:
        self.events.phase("evaluating")
        result = {"when": when, "step": self.progress.step}
        result.update(evaluate(self.model, self.val_examples, self.hp.batch_size_tokens, self.stop))
        self.progress.evals.append(result)
        self.events.emit("eval", **result)
        log.info("eval %s step %d: loss %.4f", when, result["step"], result["loss"])
        if when != "after":
            self.events.phase("training")
        return result

    # -- checkpoints -----------------------------------------------------------

    def save_checkpoint(self) -> Path | None:
        """Write ``checkpoints/step-<n>`` atomically, then keep only the newest K."""
        import torch
        from safetensors.torch import save as save_safetensors

        step = self.progress.step
        if step == self.last_checkpoint_step or step == 0:
            return None
        tensors: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            tensors["rng_cuda"] = torch.cuda.get_rng_state_all()
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        progress = {
            "spec_hash": self.spec_hash, "step": step, "elapsed_s": self.progress.elapsed_s,
            "metrics": self.progress.metrics, "evals": self.progress.evals,
            "rng_python": random.getstate(),
        }
        path = ckpt.write_complete_dir(
            ckpt.step_dir(self.checkpoints, step),
            {
                "adapter.safetensors": save_safetensors(trainable_state(self.model)),
                "state.pt": buffer.getvalue(),
                "progress.json": json.dumps(progress).encode(),
            },
        )
        self.last_checkpoint_step = step
        pruned = ckpt.prune(self.checkpoints, self.spec.keep_checkpoints)
        self.events.emit("checkpoint", step=step, path=f"checkpoints/{path.name}", pruned=pruned)
        return path

    # -- finalize ----------------------------------------------------------------

    def finalize(self) -> Path:
        """Final eval, then adapter + tokenizer + eval + metrics + manifest, COMPLETE last."""
        after = self._eval("after")
        self.events.phase("saving")
        self.staging.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.staging.exists():
            ckpt.remove_dir(self.staging)
        self.staging.mkdir(mode=0o700)
        self.model.save_pretrained(self.staging)
        self.tokenizer.save_pretrained(self.staging)
        (self.staging / "README.md").unlink(missing_ok=True)
        before = next(e for e in self.progress.evals if e["when"] == "before")
        evals = {
            "before": before, "after": after,
            "during": [e for e in self.progress.evals if e["when"] == "step"],
            "validation": "file" if self.spec.validation else "holdout",
        }
        ckpt.write_durable(self.staging / "eval.json", json.dumps(evals, indent=1).encode())
        metrics = "".join(
            json.dumps({k: m[k] for k in ("step", "loss", "lr", "tokens_per_s", "elapsed_s", "tokens")})
            + "\n"
            for m in self.progress.metrics
        )
        ckpt.write_durable(self.staging / "metrics.jsonl", metrics.encode())
        manifest = self._manifest()
        ckpt.write_durable(self.staging / "manifest.json", json.dumps(manifest, indent=1).encode())
        for name in os.listdir(self.staging):
            with open(self.staging / name, "rb") as f:
                os.fsync(f.fileno())
        ckpt.fsync_dir(self.staging)
        self.stop.check()  # a cancel that arrived by now must never publish
        digest = hashlib.sha256((self.staging / "manifest.json").read_bytes()).hexdigest()
        ckpt.write_durable(self.staging / ckpt.COMPLETE, f"manifest sha256:{digest}\n".encode())
        ckpt.fsync_dir(self.staging)
        return self.staging

    def _manifest(self) -> dict[str, Any]:
        files = {
            p.name: "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(self.staging.iterdir())
            if p.is_file()
        }
        return {
            "files": files,
            "base_model": {"name": self.spec.base_model.name, "digest": self.spec.base_model.digest},
            "datasets": {
                "train": self.spec.train.sha256,
                "validation": self.spec.validation.sha256 if self.spec.validation else None,
            },
            "spec_hash": self.spec_hash,
            "attempt": self.attempt,
            "steps": self.progress.step,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }

    # -- cleanup -------------------------------------------------------------------

    def cleanup(self) -> None:
        """Close the event log (every event is already fsynced)."""
        self.events.close()


def _tuples(value: Any) -> Any:
    """JSON turns the tuples of ``random.getstate()`` into lists; turn them back."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# ----------------------------------------------------------------- entry point

_EXIT_FOR: list[tuple[type[TrainerError], int, str]] = [
    (DatasetError, exitcodes.USER_ERROR, "user_error"),
    (ModelDigestError, exitcodes.MODEL_ERROR, "model_error"),
]


def _exit_now(code: int) -> None:
    """Leave without interpreter/torch teardown (1.3 s saved); all output is fsynced."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


def run_job(spec: JobSpec, attempt: int, fast_exit: bool = True) -> int:
    """Run one attempt of a job; return the exit code (see ``trainer.exitcodes``).

    On SIGUSR1/SIGTERM it checkpoints and, with ``fast_exit``, leaves through
    ``os._exit`` right after everything is fsynced.
    """
    stop = StopFlag()
    stop.install()
    recipe = Recipe(spec, attempt, stop)
    log.info("attempt %d of job %s, spec %s", attempt, spec.job_id or "-", recipe.spec_hash)
    if (recipe.staging / ckpt.COMPLETE).is_file():
        log.info("attempt %d already complete; nothing to do", attempt)
        recipe.events.emit("done", step=None, already_complete=True)
        return exitcodes.OK
    code = exitcodes.INTERNAL
    try:
        recipe.setup()
        recipe.train()
        if recipe.progress.step % spec.checkpoint_every_steps == 0:
            recipe.save_checkpoint()
        recipe.finalize()
        recipe.events.emit("done", step=recipe.progress.step, path=str(recipe.staging.relative_to(recipe.job_dir)))
        log.info("done: %d steps, outputs in %s", recipe.progress.step, recipe.staging)
        code = exitcodes.OK
    except Stop as s:
        code = _stop(recipe, s)
        if fast_exit:
            recipe.cleanup()
            _exit_now(code)
    except TrainerError as e:
        code, reason = next(((c, r) for t, c, r in _EXIT_FOR if isinstance(e, t)), (exitcodes.INTERNAL, "internal"))
        log.error("%s: %s", type(e).__name__, e)
        recipe.events.emit("failed", reason=reason, error=type(e).__name__, message=str(e))
    except Exception as e:  # noqa: BLE001 - the message may quote data: log the type only
        log.error("internal error %s (message withheld: it may quote data)", type(e).__name__)
        import traceback

        log.error("".join(traceback.format_tb(e.__traceback__)))
        recipe.events.emit("failed", reason="internal", error=type(e).__name__)
    recipe.cleanup()
    return code


def _stop(recipe: Recipe, s: Stop) -> int:
    """Checkpoint what exists (if the model is loaded) and record the stop."""
    if hasattr(recipe, "optimizer"):
        recipe.save_checkpoint()
    saved = recipe.last_checkpoint_step if recipe.last_checkpoint_step > 0 else None
    waited = time.monotonic() - recipe.stop.received_at if recipe.stop.received_at else None
    recipe.events.emit(
        "stopped", signal=signal.Signals(s.signum).name, exit_code=s.exit_code,
        step=recipe.progress.step, checkpoint_step=saved,
        signal_to_exit_s=round(waited, 3) if waited is not None else None,
    )
    log.info("%s: stopped at step %d, exit %d", signal.Signals(s.signum).name, recipe.progress.step, s.exit_code)
    return s.exit_code


def describe(spec: JobSpec) -> str:
    """Return the canonical spec JSON (for logs and the manifest)."""
    return spec_to_json(spec)
