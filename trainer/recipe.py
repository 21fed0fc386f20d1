"""The QLoRA recipe that runs inside one Slurm job. Read it top to bottom.

``run_job(spec)`` = ``setup`` (verify inputs, pick the device, tokenize, load
the pinned 4-bit base, add LoRA, resume from the newest complete checkpoint)
-> ``train`` (steps of up to ``batch_size_tokens`` tokens, each run as packed
micro-batch rows of at most ``max_seq_len`` tokens with gradient accumulation;
periodic checkpoints and evals, early stopping, signal flags checked after
every optimizer step) -> ``finalize`` (adapter, eval, metrics, manifest into
``attempts/<n>/staging``, ``COMPLETE`` last) -> ``cleanup``.

Early stopping (``early_stopping_patience``) tracks the best periodic ("step")
eval and keeps that adapter (in memory and as ``best.safetensors`` in every
checkpoint); ``finalize`` publishes it. The "before" eval (step 0) is a
reference only, never a candidate: publishing the untrained adapter would
surprise more than a first eval that is already worse than the base.

Signals: SIGUSR1 -> finish the step, checkpoint, exit ``REQUEUE``;
SIGTERM -> finish the step, checkpoint, exit ``CANCELLED``, never COMPLETE
(``trainer.contract.exitcodes``).

Fault injection, for the test suite only and never from the spec: ``SFT_TEST_TIER`` and
``SFT_TEST_FAULT_LR_BLOWUP_AT_STEP`` in the environment blow the learning rate up at that
step (``trainer.jobenv.test_fault_step``).

Data parallel (``world_size`` > 1, :mod:`trainer.distributed`): the same
recipe runs on every rank. A step's rows are dealt out round-robin and the
LoRA gradients summed after backward, so steps, losses and updates are those
of one process. Ranks agree (a collective) on every stop check, so they stop
after the same step; evals are sharded and their sums added up, so every
rank takes the same early-stopping decisions. Rank 0 alone writes events,
checkpoints and the staging directory; every checkpoint is followed by a
barrier. With one rank every collective is a no-op.

Sharded (``fsdp``, for a base too large for one GPU): the same recipe over
FSDP2 (:meth:`trainer.distributed.World.shard`); ranks pad short shares of a
step or an eval with zero-weight passes, and checkpoints, the best adapter and
the published adapter are gathered to rank 0 (every rank joins the gather).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from trainer import checkpoint as ckpt
from trainer import dpo, early_signals, jobenv
from trainer.catalog import resolve
from trainer.contract import exitcodes, jobdir
from trainer.contract.errors import (
    CheckpointError,
    DatasetError,
    DivergedError,
    GpuUnavailableError,
    ModelDigestError,
    PeerError,
    TrainerError,
)
from trainer.contract.spec import JobSpec, checkpoint_hash, spec_hash
from trainer.data import holdout_split, read_conversations, tokenize_all, verify_sha256
from trainer.distributed import World, dropout_seed
from trainer.events import EventLog
from trainer.heap import map_large_blocks
from trainer.model import (
    accumulate_gradients,
    adapter_config_json,
    add_lora,
    compile_layers,
    eval_metrics,
    eval_sums,
    load_base_model,
    lr_lambda,
    resolve_device,
)
from trainer.packing import Row, idle_ranks, micro_batches, plan, rows_per_step
from trainer.parent import match_lora, read_adapter

log = logging.getLogger("trainer")


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
        # set while nothing is worth saving (setup): SIGTERM then exits at once
        self.on_cancel: Callable[[], None] | None = None

    def install(self) -> None:
        """Route SIGUSR1 and SIGTERM to the flag (replaying any caught at start-up)."""
        signal.signal(signal.SIGUSR1, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        for signum in early_signals.pending():
            self._handle(signum, None)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum != signal.SIGTERM:  # cancel wins over requeue
            self.signum = signum
            self.received_at = time.monotonic()
        if signum == signal.SIGTERM and self.on_cancel is not None:
            self.on_cancel()

    def check(self) -> None:
        """Raise :class:`Stop` when a signal arrived."""
        if self.signum is not None:
            raise Stop(self.signum)


# ----------------------------------------------------------------- the recipe


@dataclass
class Progress:
    """Everything besides tensors that a checkpoint restores."""

    step: int = 0
    elapsed_s: float = 0.0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    # early stopping; the best adapter's tensors are Recipe.best_adapter
    best_step: int | None = None
    best_loss: float | None = None
    bad_evals: int = 0
    stopped_early: bool = False


def improves(loss: float, best: float | None, min_delta: float) -> bool:
    """Return True when an eval ``loss`` beats ``best`` (None: nothing yet) by more than ``min_delta``."""
    return best is None or loss < best - min_delta


class Recipe:
    """One attempt of one job (on one rank: ``world``, default a single process); ``run_job`` calls its phases."""

    def __init__(self, spec: JobSpec, attempt: int, stop: StopFlag, world: World | None = None) -> None:
        self.spec = spec
        self.hp = spec.hyperparameters
        self.attempt = attempt
        self.stop = stop
        self.world = world or World()
        self.spec_hash = spec_hash(spec)
        self.fault_step = jobenv.test_fault_step()  # None unless the test tier asks (never from the spec)
        self.checkpoint_hash = checkpoint_hash(spec)  # what a checkpoint is pinned to: any world size, any sharding
        self.job_dir = Path(spec.job_dir)
        self.checkpoints = self.job_dir / jobdir.CHECKPOINTS
        self.staging = self.job_dir.joinpath(*jobdir.staging_parts(attempt))
        if self.world.is_main:  # the only rank that writes anything
            self.job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.checkpoints.mkdir(mode=0o700, exist_ok=True)
        self.events = EventLog(self.job_dir / jobdir.EVENTS, attempt, spec.job_id, write=self.world.is_main)
        self.progress = Progress()
        self.last_checkpoint_step = -1
        self.best_adapter: dict[str, Any] | None = None  # CPU copies of the best eval's LoRA tensors
        self.preference = spec.method == "dpo"  # trainer.dpo: units are pairs, the loss is DPO's
        self.reference: dict[str, Any] | None = None  # DPO: {"train", "validation"}: (pairs, 2) log-probs

    # -- setup ---------------------------------------------------------------

    def verify_inputs(self) -> Path:
        """Check dataset sha256s and the base-model digest before any heavy work."""
        verify_sha256(self.spec.train.path, self.spec.train.sha256, "train")
        if self.spec.validation is not None:
            verify_sha256(self.spec.validation.path, self.spec.validation.sha256, "validation")
        ref = self.spec.base_model
        return resolve(ref.catalog_root, ref.name, ref.digest)

    def setup(self) -> None:
        """Verify inputs, tokenize, load the model, build optimizer, resume.

        A SIGTERM during setup exits at once (143): there is nothing to save.
        """
        self.events.emit("start", spec_hash=self.spec_hash)
        self.stop.on_cancel = self._cancel_now
        try:
            self._setup()
        finally:
            self.stop.on_cancel = None

    def _cancel_now(self) -> None:
        self.events.emit(
            "stopped",
            signal="SIGTERM",
            exit_code=exitcodes.CANCELLED,
            step=self.progress.step,
            checkpoint_step=None,
            during="setup",
        )
        log.info("SIGTERM during setup: exit %d", exitcodes.CANCELLED)
        _exit_now(exitcodes.CANCELLED)

    def _setup(self) -> None:
        self.world.check_size(self.spec.world_size)
        model_path = self.verify_inputs()  # input errors first: they are permanent, a broken GPU may not be
        self.world.select_gpu(self.spec.device)  # before any CUDA context: cuda:<local rank>
        self.device = resolve_device(self.spec.device)  # before tokenizing and loading
        if self.device == "cpu":  # before the load, which otherwise leaves ~0.5 GB of heap behind
            map_large_blocks()
        self.world.connect(self.device, sharded=self.spec.fsdp)
        self.check_stop()
        self.events.phase("tokenizing")
        import torch  # lazy: torch
        from transformers import AutoTokenizer  # lazy: transformers

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.train_examples, self.val_examples = self._load_examples()
        self.check_stop()
        self.steps = [
            (epoch, step)
            for epoch, steps in enumerate(
                plan([len(e) for e in self.train_examples], self.hp.batch_size_tokens, self.hp.seed, self.hp.epochs)
            )
            for step in steps
        ]
        self.total_steps = min(len(self.steps), self.hp.max_steps or len(self.steps))
        log.info(
            "tokenized %d train / %d validation examples, %d steps",
            len(self.train_examples),
            len(self.val_examples),
            self.total_steps,
        )
        if self.world.size > 1 and self.world.is_main:  # dealt rows[rank::size]: fewer rows than ranks idle some
            capacity = (2 if self.preference else 1) * self.hp.max_seq_len
            idle = idle_ranks(rows_per_step([s for _, s in self.steps[: self.total_steps]],
                                            [len(e) for e in self.train_examples], capacity), self.world.size)
            if idle is not None:
                log.warning("idle ranks: %s", idle)
        base = load_base_model(model_path, self.device, self.hp.max_seq_len, shardable=self.spec.fsdp)
        self.model = add_lora(base, self.hp, dropout=not self.preference)  # DPO: no dropout, as TRL
        if self.spec.fsdp:
            log.info("fsdp: %d decoder layers sharded over %d rank(s)", self.world.shard(self.model), self.world.size)
        if self.hp.torch_compile and self.device == "cuda" and self.spec.fsdp:
            log.info("torch_compile not used with fsdp")
        elif self.hp.torch_compile and self.device == "cuda":
            log.info("torch.compile: %d decoder layers", compile_layers(self.model))
        elif self.hp.torch_compile:
            log.info("torch_compile ignored on the CPU")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.hp.learning_rate, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.hp.warmup_for(self.total_steps), self.total_steps)
        )
        random.seed(self.hp.seed)
        if self.spec.init_adapter is not None:  # continued training; a checkpoint below still wins
            self._init_from_parent(self.spec.init_adapter.path, self.spec.init_adapter.sha256)
        self.resume()
        if self.preference and self.reference is None:  # a resumed run has the reference of its checkpoint
            self.reference = self._reference()
        if not self.world.all_equal(self.last_checkpoint_step):
            raise CheckpointError(
                f"rank {self.world.rank} resumed from step {max(self.last_checkpoint_step, 0)} but another rank "
                "from another step (a checkpoint unreadable on some node?): refusing to train diverged ranks"
            )

    def _init_from_parent(self, path: str, sha256: str) -> None:
        """Replace the seeded LoRA init by the parent adapter's weights (every rank reads the tar)."""
        # a DTensor's shape is the whole parameter's, not this rank's shard
        shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters() if p.requires_grad}
        self.world.load_adapter(self.model, match_lora(read_adapter(path, sha256), shapes))
        log.info("LoRA initialised from the parent adapter (%d tensors)", len(shapes))

    def check_stop(self) -> None:
        """Raise :class:`Stop` when a signal arrived (on any rank: every rank calls this at the same points).

        Called after every step and eval batch, it is also where the trainer tells the gateway it
        is alive (a ``heartbeat`` event at most every HEARTBEAT_S, for its stall detector)."""
        self.events.heartbeat()
        signum = self.world.agree_stop(self.stop.signum)
        if signum is not None:
            raise Stop(signum)

    def _load_examples(self) -> tuple[list[Any], list[Any]]:
        """The train and validation units: examples (chat data), or pairs (DPO)."""
        max_len = self.hp.max_seq_len
        if self.preference:
            train_pairs = dpo.tokenize_pairs(self.tokenizer, dpo.read_pairs(self.spec.train.path, "train"),
                                             max_len, "train")
            if self.spec.validation is not None:
                prefs = dpo.read_pairs(self.spec.validation.path, "validation")
                return train_pairs, dpo.tokenize_pairs(self.tokenizer, prefs, max_len, "validation")
            keep, held = holdout_split(len(train_pairs), self.spec.validation_split, self.hp.seed)
            return [train_pairs[i] for i in keep], [train_pairs[i] for i in held]
        train = tokenize_all(self.tokenizer, read_conversations(self.spec.train.path, "train"), max_len, "train")
        if self.spec.validation is not None:
            conversations = read_conversations(self.spec.validation.path, "validation")
            return train, tokenize_all(self.tokenizer, conversations, max_len, "validation")
        keep, held = holdout_split(len(train), self.spec.validation_split, self.hp.seed)
        return [train[i] for i in keep], [train[i] for i in held]

    def _pair_rows(self, pairs: list[Any], indices: list[int] | None = None) -> list[dpo.PairRow]:
        """DPO micro-batch rows of whole pairs (both sides of a pair in one forward)."""
        return dpo.pair_rows(pairs, list(range(len(pairs))) if indices is None else indices,
                             2 * self.hp.max_seq_len)

    def _reference(self) -> dict[str, Any]:
        """DPO: the reference policy's log-probabilities of every train and validation pair: the model as
        training starts (LoRA B = 0, or the parent's adapter), computed once; each rank scores its share
        of the rows and the shares are added up."""
        import torch  # lazy: torch

        self.events.phase("reference")
        out = {}
        for name, pairs in (("train", self.train_examples), ("validation", self.val_examples)):
            mine_rows, short = self._share(self._pair_rows(pairs))
            mine = dpo.reference_logps(self.model, mine_rows, len(pairs), self.check_stop)
            self._pad_stop_checks(short)
            summed = self.world.sum_floats(mine.reshape(-1).tolist())
            out[name] = torch.tensor(summed, dtype=torch.float32).reshape(-1, 2) if pairs else mine
        log.info("reference log-probabilities of %d train / %d validation pairs",
                 len(self.train_examples), len(self.val_examples))
        return out

    def resume(self) -> None:
        """Load the newest complete checkpoint of this job, if any (exact resume)."""
        import torch  # lazy: torch
        from safetensors.torch import load as load_safetensors  # lazy: safetensors

        removed = ckpt.clean_leftovers(self.checkpoints) if self.world.is_main else []
        if removed:
            log.info("removed %d incomplete checkpoint entries", len(removed))
        for step in reversed(ckpt.complete_steps(self.checkpoints)):
            path = ckpt.step_dir(self.checkpoints, step)
            try:
                state = json.loads((path / jobdir.CKPT_PROGRESS).read_text())
                # spec_hash: a checkpoint a gang wrote before checkpoint_hash existed
                if state["spec_hash"] not in (self.checkpoint_hash, self.spec_hash):
                    raise CheckpointError(
                        f"checkpoint {path.name} was written for another spec "
                        f"({state['spec_hash']}); refusing to mix jobs"
                    )
                adapter = load_safetensors((path / jobdir.CKPT_ADAPTER).read_bytes())
                tensors = torch.load(path / jobdir.CKPT_STATE, weights_only=True, map_location="cpu")
                has_best = state.get("best_step") is not None
                best = load_safetensors((path / jobdir.CKPT_BEST).read_bytes()) if has_best else None
                reference = tensors["reference"] if self.preference else None
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                log.warning("checkpoint %s unreadable (%s); trying an older one", path.name, type(e).__name__)
                continue
            self.world.load_adapter(self.model, adapter)
            self.world.load_optimizer(self.model, self.optimizer, tensors["optimizer"])
            self.scheduler.load_state_dict(tensors["scheduler"])
            # rank 0's; with several ranks, dropout_seed reseeds every step anyway
            torch.set_rng_state(tensors["rng_cpu"])
            if torch.cuda.is_available() and "rng_cuda" in tensors:
                torch.cuda.set_rng_state_all(tensors["rng_cuda"])
            random.setstate(_tuples(state["rng_python"]))
            self.progress = Progress(
                state["step"],
                state["elapsed_s"],
                state["metrics"],
                state["evals"],
                state.get("best_step"),
                state.get("best_loss"),
                state.get("bad_evals", 0),
                state.get("stopped_early", False),
            )
            self.best_adapter = best
            self.reference = reference
            self.last_checkpoint_step = step
            log.info("resumed from checkpoint step %d", step)
            self.events.emit("start", resumed_from_step=step)
            return

    # -- train ---------------------------------------------------------------

    def train(self) -> None:
        """Run the optimizer steps left; checkpoint, eval, stop early and honour signals."""
        progress, hp = self.progress, self.hp
        if progress.step == 0 and not progress.evals:
            self._eval("before")
        self.events.phase("training")
        self.model.train()
        started = time.monotonic() - progress.elapsed_s
        self._step_eval()  # one a signal interrupted before this resume
        while progress.step < self.total_steps and not progress.stopped_early:
            epoch, indices = self.steps[progress.step]
            rows = [] if self.preference else micro_batches([self.train_examples[i] for i in indices], hp.max_seq_len)
            tokens = sum(len(self.train_examples[i]) for i in indices)
            t0 = time.monotonic()
            lr = self.scheduler.get_last_lr()[0]
            with self.world.collectives("training step"):
                loss, trained, extra = self.preference_step(indices) if self.preference else self.optimizer_step(rows)
            if not math.isfinite(loss):    # the same summed loss on every rank: they all stop here
                raise DivergedError(f"training diverged at step {progress.step + 1}: the loss is {loss}; "
                                    "lower the learning rate (learning_rate_multiplier) and submit again")
            progress.step += 1
            dt = time.monotonic() - t0
            progress.elapsed_s = time.monotonic() - started
            metric = {
                "step": progress.step,
                "epoch": epoch,
                "loss": loss,
                "lr": lr,
                "tokens": tokens,
                "trained_tokens": trained,
                "tokens_per_s": tokens / dt if dt > 0 else None,
                "elapsed_s": round(progress.elapsed_s, 4),
                **extra,
            }
            progress.metrics.append(metric)
            self.events.emit("metrics", total_steps=self.total_steps, **metric)
            self._step_eval()
            self.check_stop()  # the only place a signal takes effect mid-training
            if progress.step % self.spec.checkpoint_every_steps == 0:
                self.save_checkpoint()

    def optimizer_step(self, rows: list[Row]) -> tuple[float, int, dict[str, Any]]:
        """One step over its micro-batch rows (gradients accumulated); returns (token-mean loss, trained
        tokens, no extra metrics).

        Data parallel: this rank runs rows ``rank, rank + size, ...``, each divided
        by the step's trained tokens over all rows, then the gradients and the
        loss are summed over ranks (identical on every rank) before clipping.
        """
        import torch  # lazy: torch

        world = self.world
        total = sum(row.n_targets for row in rows)
        if world.size > 1:  # ranks drop different units; a resume redraws the same masks (no RNG state needed)
            torch.manual_seed(dropout_seed(self.hp.seed, world.rank, self.progress.step))
        mine = rows[world.rank :: world.size]
        if world.sharded and total:  # FSDP: as many forward/backward passes on every rank
            short = -(-len(rows) // world.size) - len(mine)
            loss, trained = accumulate_gradients(self.model, mine, total, rows[0], short)
        elif world.sharded:
            loss, trained = 0.0, 0  # no trained token on any rank: no pass anywhere, gradients stay None
        else:
            loss, trained = accumulate_gradients(self.model, mine, total)
        if total:  # a step without trained tokens leaves every gradient None, on every rank
            world.sum_gradients(self.params)
        (loss,) = world.sum_floats([loss])
        self._update()
        return loss, trained, {}

    def preference_step(self, indices: list[int]) -> tuple[float, int, dict[str, Any]]:
        """One DPO step over the pairs ``indices``: rows of whole pairs dealt out round-robin like
        :meth:`optimizer_step`'s, gradients of the mean pair loss summed over ranks. Returns
        (mean pair loss, trained tokens, the step's reward margin and accuracy)."""
        import torch  # lazy: torch

        world = self.world
        if world.size > 1:
            torch.manual_seed(dropout_seed(self.hp.seed, world.rank, self.progress.step))
        rows = self._pair_rows(self.train_examples, indices)
        assert self.reference is not None
        sums = dpo.accumulate_pair_gradients(self.model, rows[world.rank :: world.size], len(indices),
                                             self.reference["train"], self.hp.beta)
        world.sum_gradients(self.params)
        step = dpo.preference_metrics(dpo.PreferenceSums.from_list(world.sum_floats(sums.as_list())))
        self._update()
        extra = {k: step[k] for k in ("reward_margin", "reward_accuracy")}
        return float(step["loss"] or 0.0), int(step["tokens"] or 0), extra

    def _update(self) -> None:
        """Clip, step the optimizer and the schedule, clear the gradients: the end of every step."""
        import torch  # lazy: torch

        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        if self.fault_step == self.progress.step + 1:   # the test suite's fault (jobenv.test_fault_step)
            for group in self.optimizer.param_groups:
                group["lr"] = 1e30                  # the scheduler's next step sets it back
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _step_eval(self) -> None:
        """Run the periodic eval due at this step, once, and feed it to early stopping.

        Due every ``eval_every_steps`` and, with early stopping, at the last
        step too (its adapter is a candidate). Skipped when already recorded:
        after a resume only an eval a signal interrupted is redone.
        """
        step, evals = self.progress.step, self.progress.evals
        every, patience = self.hp.eval_every_steps, self.hp.early_stopping_patience
        if every is None or step == 0:
            return
        if step % every and not (patience is not None and step == self.total_steps):
            return
        if evals and evals[-1]["when"] == "step" and evals[-1]["step"] == step:
            return
        result = self._eval("step")
        if patience is not None:
            self._early_stopping(result["loss"], patience)

    def _early_stopping(self, loss: float, patience: int) -> None:
        """Keep the adapter of an improving eval; after ``patience`` evals without one, stop."""
        progress = self.progress
        if improves(loss, progress.best_loss, self.hp.early_stopping_min_delta):
            progress.best_step, progress.best_loss, progress.bad_evals = progress.step, loss, 0
            # clone: on CPU trainable_state returns views of the live parameters (sharded: rank 0's copy only)
            self.best_adapter = {n: t.clone() for n, t in self.world.adapter_state(self.model).items()}
            return
        progress.bad_evals += 1
        if progress.bad_evals >= patience and progress.step < self.total_steps:
            progress.stopped_early = True
            self.events.emit(
                "early_stop",
                step=progress.step,
                best_step=progress.best_step,
                best_loss=progress.best_loss,
                bad_evals=progress.bad_evals,
            )
            log.info(
                "early stop at step %d: %d evals without improvement, best step %s (loss %.4f)",
                progress.step,
                progress.bad_evals,
                progress.best_step,
                progress.best_loss,
            )

    def _eval(self, when: str, step: int | None = None) -> dict[str, Any]:
        """Evaluate the model now; ``step`` is the step its weights come from (default: now)."""
        self.events.phase("evaluating")
        result: dict[str, Any] = {"when": when, "step": self.progress.step if step is None else step}
        if self.preference:
            result.update(self._preference_eval())
            return self._record_eval(when, result)
        rows = micro_batches(self.val_examples, self.hp.max_seq_len)
        mine, short = self._share(rows)
        if self.world.sharded and rows:  # FSDP: as many forwards (and stop agreements) on every rank
            with self.world.collectives("eval"):
                sums = eval_sums(self.model, mine, self.check_stop, rows[0], short)
        else:
            sums = eval_sums(self.model, mine, self.check_stop)
            self._pad_stop_checks(short)
        total, tokens, correct, s1, s2, n = self.world.sum_floats([float(x) for x in sums])
        result.update(eval_metrics(total, int(tokens), int(correct), len(self.val_examples), (s1, s2, int(n))))
        return self._record_eval(when, result)

    def _preference_eval(self) -> dict[str, Any]:
        """DPO: the validation pairs' metrics (:func:`trainer.dpo.preference_metrics`), rows sharded over ranks."""
        assert self.reference is not None
        mine, short = self._share(self._pair_rows(self.val_examples))
        sums = dpo.eval_pair_sums(self.model, mine, self.reference["validation"], self.hp.beta, self.check_stop)
        self._pad_stop_checks(short)
        metrics = dpo.preference_metrics(dpo.PreferenceSums.from_list(self.world.sum_floats(sums.as_list())))
        return {**metrics, "examples": len(self.val_examples)}

    def _share(self, rows: list[Any]) -> tuple[list[Any], int]:
        """This rank's rows of an eval-like pass (``rank, rank + size, ...``) and how many fewer it has
        than the ranks with the most."""
        mine = rows[self.world.rank :: self.world.size]
        return mine, -(-len(rows) // self.world.size) - len(mine)

    def _pad_stop_checks(self, short: int) -> None:
        """As many stop agreements as the ranks with ``short`` rows more make (every rank agrees as often)."""
        for _ in range(short):
            self.check_stop()

    def _record_eval(self, when: str, result: dict[str, Any]) -> dict[str, Any]:
        self.progress.evals.append(result)
        self.events.emit("eval", **result)
        log.info("eval %s step %d: loss %.4f", when, result["step"], result["loss"])
        if when != "after":
            self.events.phase("training")
        return result

    # -- checkpoints -----------------------------------------------------------

    def save_checkpoint(self, sync: bool = True) -> Path | None:
        """Write ``checkpoints/step-<n>`` atomically, then keep only the newest K and the best eval's; return its path.

        With early stopping each one also holds the best adapter so far (``best.safetensors``).
        Data parallel: rank 0 writes (its state is the whole, replicated state;
        other ranks return None), then, with ``sync``, every rank waits for it,
        so no rank runs more than one step ahead of a durable checkpoint.
        """
        step = self.progress.step
        if step == self.last_checkpoint_step or step == 0:
            return None
        # sharded: every rank joins the gathers; rank 0 gets the whole state (unsharded: only rank 0 reads it)
        writes = self.world.is_main or self.world.sharded
        adapter = self.world.adapter_state(self.model) if writes else {}
        optimizer = self.world.optimizer_state(self.model, self.optimizer) if writes else {}
        path = self._write_checkpoint(step, adapter, optimizer) if self.world.is_main else None
        self.last_checkpoint_step = step  # on every rank: they return early at the same steps
        if sync:
            self.world.barrier()
        return path

    def _write_checkpoint(self, step: int, adapter: dict[str, Any], optimizer: dict[str, Any]) -> Path:
        import torch  # lazy: torch
        from safetensors.torch import save as save_safetensors  # lazy: safetensors

        tensors: dict[str, Any] = {
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
        }
        if self.reference is not None:  # DPO: a resume scores against the very same reference
            tensors["reference"] = self.reference
        if torch.cuda.is_available() and self.world.size == 1:  # several ranks: every visible GPU's would be read
            tensors["rng_cuda"] = torch.cuda.get_rng_state_all()
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        progress = {
            "spec_hash": self.checkpoint_hash,
            "step": step,
            "elapsed_s": self.progress.elapsed_s,
            "metrics": self.progress.metrics,
            "evals": self.progress.evals,
            "rng_python": random.getstate(),
            "best_step": self.progress.best_step,
            "best_loss": self.progress.best_loss,
            "bad_evals": self.progress.bad_evals,
            "stopped_early": self.progress.stopped_early,
        }
        files = {
            jobdir.CKPT_ADAPTER: save_safetensors(adapter),
            jobdir.CKPT_STATE: buffer.getvalue(),
            jobdir.CKPT_PROGRESS: json.dumps(progress).encode(),
            jobdir.ADAPTER_CONFIG: adapter_config_json(self.model),
        }
        if self.best_adapter is not None:  # inside each checkpoint: pruning never loses it
            files[jobdir.CKPT_BEST] = save_safetensors(self.best_adapter)
        path = ckpt.write_complete_dir(ckpt.step_dir(self.checkpoints, step), files)
        self.last_checkpoint_step = step  # durable now, whatever pruning or the event meet
        # the newest K stay, and the best eval's step's (early stopping): the tenant's best model so far
        best = [self.progress.best_step] if self.progress.best_step is not None else []
        pruned, freed = ckpt.prune_measured(self.checkpoints, self.spec.keep_checkpoints, best)
        self.events.emit("checkpoint", step=step, path=f"{jobdir.CHECKPOINTS}/{path.name}", pruned=pruned,
                         pruned_bytes=freed)
        return path

    # -- finalize ----------------------------------------------------------------

    def finalize(self) -> Path:
        """Final eval, then adapter + tokenizer + eval + metrics + manifest, COMPLETE last.

        With early stopping the best eval's adapter is loaded back first, so the
        "after" eval and the published adapter are those of ``best_step``.
        Data parallel: every rank evaluates its share, rank 0 alone writes; the
        ranks agree on a signal before and after COMPLETE, as one process checks its own.
        """
        published = self._load_best()
        after = self._eval("after", published)
        self.events.phase("saving")
        adapter = self.world.adapter_state(self.model) if self.world.sharded else None  # every rank gathers
        if self.world.is_main:
            self._write_staging(after, adapter)
        self.check_stop()  # a cancel that arrived by now must never publish
        if self.world.is_main:
            digest = hashlib.sha256((self.staging / jobdir.MANIFEST).read_bytes()).hexdigest()
            ckpt.write_durable(self.staging / jobdir.COMPLETE, f"manifest sha256:{digest}\n".encode())
            ckpt.fsync_dir(self.staging)
        # a SIGTERM that arrived while COMPLETE was being written; with several ranks this collective
        # is also the final barrier: no rank returns before rank 0 has published
        if self.world.agree_stop(self.stop.signum) == signal.SIGTERM:
            if self.world.is_main:
                (self.staging / jobdir.COMPLETE).unlink()
                ckpt.fsync_dir(self.staging)
            raise Stop(signal.SIGTERM)
        return self.staging

    def _write_staging(self, after: dict[str, Any], adapter: dict[str, Any] | None = None) -> None:
        """Everything of the staging directory but COMPLETE, each file fsynced (``adapter``: gathered, sharded)."""
        self.staging.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.staging.exists():
            ckpt.remove_dir(self.staging)
        self.staging.mkdir(mode=0o700)
        if adapter is None:
            self.model.save_pretrained(self.staging)
        else:  # peft writes the given state instead of reading the (sharded) parameters
            self.model.save_pretrained(self.staging, state_dict=adapter)
        self.tokenizer.save_pretrained(self.staging)
        (self.staging / "README.md").unlink(missing_ok=True)
        before = next(e for e in self.progress.evals if e["when"] == "before")
        evals = {
            "before": before,
            "after": after,
            "during": [e for e in self.progress.evals if e["when"] == "step"],
            "validation": "file" if self.spec.validation else "holdout",
            "best_step": self.progress.best_step,
            "best_loss": self.progress.best_loss,
            "stopped_early": self.progress.stopped_early,
        }
        ckpt.write_durable(self.staging / jobdir.EVAL, json.dumps(evals, indent=1).encode())
        metrics = "".join(
            json.dumps({k: m[k] for k in ("step", "loss", "lr", "tokens_per_s", "elapsed_s", "tokens")}) + "\n"
            for m in self.progress.metrics
        )
        ckpt.write_durable(self.staging / jobdir.METRICS, metrics.encode())
        manifest = self._manifest()
        ckpt.write_durable(self.staging / jobdir.MANIFEST, json.dumps(manifest, indent=1).encode())
        for name in os.listdir(self.staging):
            with open(self.staging / name, "rb") as f:
                os.fsync(f.fileno())
        ckpt.fsync_dir(self.staging)

    def _load_best(self) -> int:
        """Put the best adapter back into the model (early stopping); return the step it is from."""
        progress = self.progress
        if self.best_adapter is None or progress.best_step in (None, progress.step):
            return progress.step
        # the last step's own state first: a signal from here on then saves nothing newer,
        # so no checkpoint ever holds the best adapter as the current one
        self.save_checkpoint()
        self.world.load_adapter(self.model, self.best_adapter)
        log.info("publishing the adapter of step %d (loss %.4f)", progress.best_step, progress.best_loss)
        return progress.best_step

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
            "method": self.spec.method,
            "attempt": self.attempt,
            "steps": self.progress.step,
            "best_step": self.progress.best_step,
            "train_seconds": round(self.progress.elapsed_s, 3),
            "world_size": self.world.size,
            "fsdp": self.world.sharded,
            "versions": _versions(),
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }

    # -- cleanup -------------------------------------------------------------------

    def cleanup(self) -> None:
        """Close the event log (every event is already fsynced)."""
        self.events.close()


def _versions() -> dict[str, str]:
    """The versions of what trained the adapter (python and the libraries of the recipe), for its lineage."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("slurm-finetune", "torch", "transformers", "peft", "bitsandbytes", "safetensors"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _tuples(value: Any) -> Any:
    """JSON turns the tuples of ``random.getstate()`` into lists; turn them back."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# ----------------------------------------------------------------- entry point

_EXIT_FOR: list[tuple[type[TrainerError], int, str]] = [
    (DatasetError, exitcodes.USER_ERROR, "user_error"),
    (DivergedError, exitcodes.USER_ERROR, "user_error"),
    (ModelDigestError, exitcodes.MODEL_ERROR, "model_error"),
    (GpuUnavailableError, exitcodes.GPU_UNAVAILABLE, "gpu_unavailable"),
    (PeerError, exitcodes.PEER_LOST, "peer_lost"),
]


def _exit_now(code: int) -> None:
    """Leave without interpreter/torch teardown (1.3 s saved); all output is fsynced."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_job(spec: JobSpec, attempt: int, fast_exit: bool = True, world: World | None = None) -> int:
    """Run one attempt of a job on this rank of ``world`` (default: one process); return the exit code.

    Exit codes: see ``trainer.contract.exitcodes``; every rank of a data-parallel run
    returns the same one unless a rank fails. On SIGUSR1/SIGTERM it checkpoints.
    With ``fast_exit`` (a real trainer process) it never returns: it leaves
    through ``os._exit`` once everything is fsynced, with no torch or gloo
    teardown; without, it leaves the process group and returns.
    """
    stop = StopFlag()
    stop.install()
    recipe = Recipe(spec, attempt, stop, world)
    log.info("attempt %d of job %s, spec %s, %r", attempt, spec.job_id or "-", recipe.spec_hash, recipe.world)
    if (recipe.staging / jobdir.COMPLETE).is_file():
        log.info("attempt %d already complete; nothing to do", attempt)
        recipe.events.emit("done", step=None, already_complete=True)
        return exitcodes.OK
    code, finished = exitcodes.INTERNAL, False
    try:
        recipe.setup()
        recipe.train()
        if recipe.progress.step % spec.checkpoint_every_steps == 0:
            recipe.save_checkpoint()
        recipe.finalize()
        recipe.events.emit("done", step=recipe.progress.step, path=str(recipe.staging.relative_to(recipe.job_dir)))
        log.info("done: %d steps, outputs in %s", recipe.progress.step, recipe.staging)
        code = exitcodes.OK
        finished = True
    except Stop as s:
        code = _stop(recipe, s)
        finished = True
    except TrainerError as e:
        code, reason = next(((c, r) for t, c, r in _EXIT_FOR if isinstance(e, t)), (exitcodes.INTERNAL, "internal"))
        log.error("%s: %s", type(e).__name__, e)
        recipe.events.emit("failed", reason=reason, error=type(e).__name__, message=str(e))
    except Exception as e:  # noqa: BLE001 - the message may quote data: log the type only
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            code = _storage_full(recipe, quota=e.errno == errno.EDQUOT)
        else:
            log.error("internal error %s (message withheld: it may quote data)", type(e).__name__)
            import traceback

            log.error("".join(traceback.format_tb(e.__traceback__)))
            recipe.events.emit("failed", reason="internal", error=type(e).__name__)
    recipe.cleanup()
    if fast_exit:
        # every output is fsynced and every rank is past the last barrier: leave without tearing down
        # the process group or the interpreter, whose gloo threads can abort a rank that already
        # finished ("terminate called without an active exception", exit -6 on 1 run in ~50)
        _exit_now(code)
    if finished:
        recipe.world.close()
    return code


def _storage_full(recipe: Recipe, *, quota: bool) -> int:
    """Say why in a failure event (the half-written checkpoint is already gone, so it fits) and return the
    exit code: EDQUOT is the tenant's own quota (a user error: it can free space or ask for more), ENOSPC
    the shared filesystem (internal)."""
    kept = max(recipe.last_checkpoint_step, 0)
    where = f"the last complete checkpoint (step {kept}) is kept" if kept else "no checkpoint was complete yet"
    if quota:
        log.error("storage quota exceeded in the job directory")
        reason, code, error = "user_error", exitcodes.USER_ERROR, "StorageQuotaExceeded"
        message = f"storage quota exceeded: delete files or ask for more; {where}"
    else:
        log.error("no space left in the job directory")
        reason, code, error = "internal", exitcodes.INTERNAL, "StorageFull"
        message = f"the shared storage is full (no space left on device): ask your administrator; {where}"
    try:
        recipe.events.emit("failed", reason=reason, error=error, message=message)
    except OSError:
        log.error("the failure event did not fit either")
    return code


def _stop(recipe: Recipe, s: Stop) -> int:
    """Checkpoint what exists (if the model is loaded) and record the stop; every rank, the same ``s``."""
    if hasattr(recipe, "optimizer"):
        recipe.save_checkpoint(sync=False)  # the one barrier below
    saved = recipe.last_checkpoint_step if recipe.last_checkpoint_step > 0 else None
    waited = time.monotonic() - recipe.stop.received_at if recipe.stop.received_at else None
    recipe.events.emit(
        "stopped",
        signal=signal.Signals(s.signum).name,
        exit_code=s.exit_code,
        step=recipe.progress.step,
        checkpoint_step=saved,
        signal_to_exit_s=round(waited, 3) if waited is not None else None,
    )
    log.info("%s: stopped at step %d, exit %d", signal.Signals(s.signum).name, recipe.progress.step, s.exit_code)
    try:
        # no rank leaves before rank 0 is done: srun --kill-on-bad-exit would kill it mid-checkpoint
        recipe.world.barrier()
    except PeerError as e:  # rank 0's checkpoint is written either way
        log.warning("%s", e)
    return s.exit_code
