"""A simulated trainer for capacity benchmarks: ``python -m trainer.simulate SPEC_PATH [--speedup F]``.

A site that enables simulation (a site setting, never a tenant's) has its batch script run this in
place of ``python -m trainer run SPEC_PATH``. It does no ML, but from the outside it behaves like
:mod:`trainer.recipe`: the same events in ``events.jsonl`` at the same cadence (start, phases, a
``metrics`` event per optimizer step, heartbeats, evals before / every ``eval_every_steps`` / after,
checkpoints, done), atomic checkpoints ``checkpoints/step-<n>`` every ``checkpoint_every_steps``
pruned to ``keep_checkpoints``, the staging directory ``attempts/<n>/staging`` with ``COMPLETE``
(``manifest sha256:<hex>``) last, which the gateway's ``verify_staging`` and ``publish_build``
accept, and the exit codes of :mod:`trainer.contract.exitcodes`. SIGUSR1 checkpoints and exits
REQUEUE; SIGTERM checkpoints and exits CANCELLED, never COMPLETE; both act within ~0.2 s, giving
up the step in progress. An attempt resumes from the newest complete checkpoint and simulates
only the steps left. In a gang (``trainer.jobenv.world_env``) rank 0 alone writes; other ranks
keep the same schedule, then wait for rank 0's COMPLETE.

The plan, from file sizes only: tokens ~ bytes / 4 (an approximation for English chat JSONL,
JSON syntax included), ``epochs`` times; steps per epoch = ceil(epoch tokens /
``batch_size_tokens``), capped by ``max_steps``; no validation file: ``validation_split`` of the
train tokens is held out, as the real trainer does. Training time (wall clock): ``--seconds``
when given (exact job durations for a workload generator; ``--speedup`` is then ignored), else
trained tokens / (``--tokens-per-s`` x world size) / ``--speedup``; the default, 2000 tokens/s per
GPU, is the order of a 7B QLoRA job on one A100/H100-class GPU. Steps end at fixed deadlines, so a
loaded host does not stretch the run; the loss falls along a fixed, seeded curve.

Not simulated: no model, tokenizer or data is read (no sha256 check of the datasets, no catalog
lookup of the base model), no early stopping, evals take no time, no tokenizer files in the
staging, no ``state.pt`` in checkpoints (the gateway never reads it). The spec is read with plain
``json`` (peak RSS ~22 MB, ~10 MB proportional with 320 running; pydantic would add ~12 MB of
private memory to each) and the contract's defaults from its source (:func:`contract_defaults`).
Without pydantic there is no canonical spec hash: the manifest's ``spec_hash`` is None (the
lineage says unverified), and checkpoints are pinned to a ``simulated:`` hash, which a real
trainer's resume refuses.
``--fail-at-step N`` injects a failure (a ``failed`` event, exit INTERNAL) after step N.
"""

from __future__ import annotations

import argparse
import array
import ast
import hashlib
import json
import logging
import math
import os
import platform
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from trainer import checkpoint as ckpt
from trainer import jobenv
from trainer.contract import exitcodes, jobdir
from trainer.events import EventLog

log = logging.getLogger("trainer.simulate")

SPEC_SOURCE = Path(jobdir.__file__).with_name("spec.py")
"""``trainer.contract.spec``, whose defaults :func:`contract_defaults` reads without importing it."""
BYTES_PER_TOKEN = 4
TOKENS_PER_EXAMPLE = 250     # validation examples reported by an eval: eval tokens / this
TOKENS_PER_S = 2000.0        # per GPU
SLICE_S = 0.2                # longest sleep between two looks at the signal flag
PEER_WAIT_S = 120.0          # how long a rank other than 0 waits for rank 0's COMPLETE
WIDTH = 8                    # the simulated model's hidden size: adapters stay a few kB
MODULES = ("q_proj", "v_proj")


class Stop(Exception):
    """A signal arrived (SIGUSR1: requeue, SIGTERM: cancel)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = exitcodes.CANCELLED if signum == signal.SIGTERM else exitcodes.REQUEUE


class Failure(Exception):
    """A failure reported in a ``failed`` event: (reason, error class name, message, exit code)."""

    def __init__(self, reason: str, error: str, message: str, code: int) -> None:
        super().__init__(message)
        self.reason, self.error, self.message, self.code = reason, error, message, code


class Flag:
    """Signal handlers only set this; the loop looks at it at least every SLICE_S."""

    signum: int | None = None
    received_at: float | None = None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The handler of SIGUSR1 and SIGTERM."""
        if self.signum != signal.SIGTERM:  # cancel wins over requeue
            self.signum, self.received_at = signum, time.monotonic()

    def check(self) -> None:
        """Raise :class:`Stop` when a signal arrived."""
        if self.signum is not None:
            raise Stop(self.signum)


@dataclass(frozen=True)
class Plan:
    total_steps: int
    steps_per_epoch: int
    epoch_tokens: int
    step_s: float
    eval_tokens: int

    def step_tokens(self, step: int) -> int:
        """The tokens of (1-based) ``step``: the epoch's tokens split evenly over its steps."""
        j, n = (step - 1) % self.steps_per_epoch, self.steps_per_epoch
        return self.epoch_tokens * (j + 1) // n - self.epoch_tokens * j // n


def make_plan(hp: dict[str, Any], train_bytes: int, val_bytes: int | None, split: float, *, world_size: int,
              tokens_per_s: float, speedup: float, seconds: float | None) -> Plan:
    """The steps, tokens and wall time of a run (see the module docstring)."""
    tokens = max(1, train_bytes // BYTES_PER_TOKEN)
    if val_bytes is None:
        held = max(1, int(tokens * split))
        tokens, eval_tokens = max(1, tokens - held), held
    else:
        eval_tokens = max(1, val_bytes // BYTES_PER_TOKEN)
    per_epoch = max(1, math.ceil(tokens / hp["batch_size_tokens"]))
    total = per_epoch * hp["epochs"]
    total = min(total, hp["max_steps"]) if hp["max_steps"] else total
    trained = total * tokens / per_epoch
    train_s = seconds if seconds is not None else trained / (tokens_per_s * world_size) / speedup
    return Plan(total, per_epoch, tokens, train_s / total, eval_tokens)


def loss_at(step: int, total: int, seed: int) -> float:
    """A plausible training loss: from ~2.2 towards 1.0, with seeded noise of +-0.02."""
    noise = random.Random(f"{seed}:{step}").random() - 0.5
    return 1.0 + 1.2 * math.exp(-3.0 * step / total) + 0.04 * noise


def lr_at(step: int, total: int, hp: dict[str, Any]) -> float:
    """The learning rate of 0-based ``step``: ``trainer.model.lr_lambda``'s warm-up and linear decay."""
    ratio = hp["warmup_ratio"]
    warmup = hp["warmup_steps"] if ratio is None else math.ceil(ratio * total - 1e-9)
    factor = (step + 1) / (warmup + 1) if step < warmup else max(0.0, (total - step) / max(1, total - warmup))
    return float(hp["learning_rate"]) * factor


def safetensors_bytes(tensors: dict[str, tuple[list[int], bytes]]) -> bytes:
    """A safetensors file of float32 tensors (name -> (shape, little-endian bytes))."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + b"".join(data for _, data in tensors.values())


def adapter(r: int, step: int, peft_names: bool) -> bytes:
    """LoRA A (r, WIDTH) and B (WIDTH, r) of layer 0's MODULES; names as the trainer's trainable state
    (``….lora_A.default.weight``) or, ``peft_names``, as ``save_pretrained`` writes them."""
    tag = "" if peft_names else ".default"
    out: dict[str, tuple[list[int], bytes]] = {}
    for module in MODULES:
        stem = f"base_model.model.model.layers.0.self_attn.{module}"
        a = array.array("f", (((i * 7919) % 97 - 48) / 1000 for i in range(r * WIDTH)))
        b = array.array("f", (step * 1e-4 * ((i % 5) - 2) for i in range(WIDTH * r)))
        if sys.byteorder != "little":
            a.byteswap()
            b.byteswap()
        out[f"{stem}.lora_A{tag}.weight"] = ([r, WIDTH], a.tobytes())
        out[f"{stem}.lora_B{tag}.weight"] = ([WIDTH, r], b.tobytes())
    return safetensors_bytes(out)


def contract_defaults(source: Path = SPEC_SOURCE) -> dict[str, dict[str, Any]]:
    """The literal defaults of the contract's ``Hyperparameters`` and ``JobSpec`` fields, by class name.

    Read from the module's source, not by importing it: pydantic would cost ~12 MB of private memory
    in each of hundreds of simulated jobs. The contract stays the one place they are written (a test
    compares these with the pydantic models'); a default that is not a literal is left out."""
    out: dict[str, dict[str, Any]] = {}
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name in ("Hyperparameters", "JobSpec"):
            fields = out.setdefault(node.name, {})
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
                    try:
                        fields[item.target.id] = ast.literal_eval(item.value)
                    except ValueError:
                        continue
    return out


_DEFAULTS = contract_defaults()
HYPERPARAMETERS: dict[str, Any] = _DEFAULTS["Hyperparameters"]
JOB: dict[str, Any] = _DEFAULTS["JobSpec"]
"""The defaults of the contract's hyperparameters and spec fields (read by :func:`contract_defaults`)."""


def read_spec(path: Path) -> dict[str, Any]:
    """The spec's JSON with the contract's defaults filled in. Raises ValueError (or OSError)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    train = data.get("train") if isinstance(data, dict) else None
    if not (isinstance(train, dict) and isinstance(train.get("path"), str) and isinstance(data.get("job_dir"), str)):
        raise ValueError("the spec needs job_dir and train.path")
    spec = {**JOB, **data, "hyperparameters": {**HYPERPARAMETERS, **(data.get("hyperparameters") or {})}}
    counts = [(f"hyperparameters.{k}", spec["hyperparameters"][k]) for k in ("epochs", "batch_size_tokens", "lora_r")]
    for name, value in counts + [(k, spec[k]) for k in ("checkpoint_every_steps", "keep_checkpoints", "world_size")]:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} is not a positive integer")
    return spec


class Simulation:
    """One attempt of one job on one rank."""

    def __init__(self, spec: dict[str, Any], attempt: int, rank: int, size: int, flag: Flag,
                 args: argparse.Namespace) -> None:
        self.spec, self.hp, self.attempt, self.size, self.flag, self.args = (
            spec, spec["hyperparameters"], attempt, size, flag, args)
        self.main = rank == 0
        self.job_dir = Path(spec["job_dir"])
        self.checkpoints = self.job_dir / jobdir.CHECKPOINTS
        self.staging = self.job_dir.joinpath(*jobdir.staging_parts(attempt))
        layout_free = {k: v for k, v in spec.items() if k not in ("world_size", "fsdp")}  # as checkpoint_hash
        canonical = json.dumps(layout_free, sort_keys=True, separators=(",", ":")).encode()
        self.pin = "simulated:sha256:" + hashlib.sha256(canonical).hexdigest()
        if self.main:
            self.checkpoints.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.events = EventLog(self.job_dir / jobdir.EVENTS, attempt, spec.get("job_id"), write=self.main)
        self.step, self.elapsed, self.last_checkpoint = 0, 0.0, -1
        self.metrics: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.plan: Plan | None = None

    def run(self) -> int:
        """The attempt, start to end; returns the exit code."""
        if (self.staging / jobdir.COMPLETE).is_file():
            self.events.emit("done", step=None, already_complete=True)
            return exitcodes.OK
        try:
            self.events.emit("start", spec_hash=None, simulated=True)
            self.setup()
            self.train()
            if self.step % self.spec["checkpoint_every_steps"] == 0:
                self.save_checkpoint()
            self.finalize()
            self.events.emit("done", step=self.step, path=str(self.staging.relative_to(self.job_dir)))
            return exitcodes.OK
        except Stop as s:
            return self.stopped(s)
        except Failure as f:
            self.events.emit("failed", reason=f.reason, error=f.error, message=f.message)
            return f.code
        except Exception as e:  # noqa: BLE001 - reported as the recipe does: the type only
            log.exception("internal error")
            self.events.emit("failed", reason="internal", error=type(e).__name__)
            return exitcodes.INTERNAL
        finally:
            self.events.close()

    def setup(self) -> None:
        """Check the launch, plan the run from the datasets' sizes, resume."""
        if self.size != self.spec["world_size"]:
            raise Failure("internal", "LaunchError", f"spec asks for {self.spec['world_size']} ranks, this run has "
                          f"{self.size}", exitcodes.INTERNAL)
        self.events.phase("tokenizing")
        try:
            train_bytes = os.stat(self.spec["train"]["path"]).st_size
            val = self.spec.get("validation")
            val_bytes = os.stat(val["path"]).st_size if val else None
        except OSError as e:
            raise Failure("user_error", "DatasetError", f"dataset file unreadable: {e.strerror}",
                          exitcodes.USER_ERROR) from None
        a = self.args
        self.plan = make_plan(self.hp, train_bytes, val_bytes, self.spec["validation_split"], world_size=self.size,
                              tokens_per_s=a.tokens_per_s, speedup=a.speedup, seconds=a.seconds)
        self.resume()

    def resume(self) -> None:
        """Continue from the newest complete checkpoint, if any (as ``Recipe.resume``)."""
        if self.main:
            ckpt.clean_leftovers(self.checkpoints)
        for step in reversed(ckpt.complete_steps(self.checkpoints)):
            try:
                state = json.loads((ckpt.step_dir(self.checkpoints, step) / jobdir.CKPT_PROGRESS).read_text())
            except (OSError, ValueError):
                continue
            if state.get("spec_hash") != self.pin:
                raise Failure("internal", "CheckpointError", f"checkpoint step-{step} was written for another spec "
                              f"({state.get('spec_hash')}); refusing to mix jobs", exitcodes.INTERNAL)
            self.step, self.elapsed = state["step"], state["elapsed_s"]
            self.metrics, self.evals = state["metrics"], state["evals"]
            self.last_checkpoint = step
            log.info("resumed from checkpoint step %d", step)
            self.events.emit("start", resumed_from_step=step)
            return

    def train(self) -> None:
        """The steps left, each ending at its deadline; checkpoints, evals and signals as the recipe's."""
        plan, hp = self.plan, self.hp
        assert plan is not None
        if self.step == 0 and not self.evals:
            self.eval("before")
        self.events.phase("training")
        started, first, base = time.monotonic() - self.elapsed, self.step, time.monotonic()
        while self.step < plan.total_steps:
            t0 = time.monotonic()
            self.sleep_until(base + (self.step + 1 - first) * plan.step_s)
            lr = lr_at(self.step, plan.total_steps, hp)
            self.step += 1
            tokens, dt = plan.step_tokens(self.step), time.monotonic() - t0
            self.elapsed = time.monotonic() - started
            metric = {"step": self.step, "epoch": (self.step - 1) // plan.steps_per_epoch,
                      "loss": loss_at(self.step, plan.total_steps, hp["seed"]), "lr": lr, "tokens": tokens,
                      "trained_tokens": tokens, "tokens_per_s": tokens / dt if dt > 0 else None,
                      "elapsed_s": round(self.elapsed, 4)}
            self.metrics.append(metric)
            self.events.emit("metrics", total_steps=plan.total_steps, **metric)
            if hp["eval_every_steps"] and self.step % hp["eval_every_steps"] == 0:
                self.eval("step")
            self.flag.check()
            if self.step == self.args.fail_at_step:
                raise Failure("internal", "SimulatedFailure", f"simulated failure at step {self.step} "
                              "(--fail-at-step)", exitcodes.INTERNAL)
            if self.step % self.spec["checkpoint_every_steps"] == 0:
                self.save_checkpoint()

    def sleep_until(self, deadline: float) -> None:
        """Sleep in slices of at most SLICE_S, raising Stop on a signal; heartbeats as the recipe's."""
        while True:
            self.flag.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, SLICE_S))
            self.events.heartbeat()

    def eval(self, when: str) -> dict[str, Any]:
        """An instant eval whose loss follows the training curve (a little above it)."""
        assert self.plan is not None
        self.events.phase("evaluating")
        loss = 0.05 + loss_at(self.step, self.plan.total_steps, self.hp["seed"] + 1)
        result = {"when": when, "step": self.step, "loss": loss, "perplexity": math.exp(loss),
                  "token_accuracy": round(0.9 - 0.25 * loss, 4), "tokens": self.plan.eval_tokens,
                  "examples": max(1, self.plan.eval_tokens // TOKENS_PER_EXAMPLE), "loss_stderr": 0.02}
        self.evals.append(result)
        self.events.emit("eval", **result)
        if when != "after":
            self.events.phase("training")
        return result

    def save_checkpoint(self) -> None:
        """``checkpoints/step-<n>`` atomically (rank 0), pruned to the newest ``keep_checkpoints``."""
        if self.step in (self.last_checkpoint, 0):
            return
        self.last_checkpoint = self.step
        if not self.main:
            return
        progress = {"spec_hash": self.pin, "step": self.step, "elapsed_s": self.elapsed, "metrics": self.metrics,
                    "evals": self.evals, "rng_python": random.getstate(), "best_step": None, "best_loss": None,
                    "bad_evals": 0, "stopped_early": False, "simulated": True}
        files = {jobdir.CKPT_ADAPTER: adapter(self.hp["lora_r"], self.step, peft_names=False),
                 jobdir.CKPT_PROGRESS: json.dumps(progress).encode()}
        path = ckpt.write_complete_dir(ckpt.step_dir(self.checkpoints, self.step), files)
        pruned, freed = ckpt.prune_measured(self.checkpoints, self.spec["keep_checkpoints"])
        self.events.emit("checkpoint", step=self.step, path=f"{jobdir.CHECKPOINTS}/{path.name}", pruned=pruned,
                         pruned_bytes=freed)

    def finalize(self) -> None:
        """The "after" eval, then the staging directory, COMPLETE last (other ranks: wait for it)."""
        after = self.eval("after")
        self.events.phase("saving")
        if not self.main:
            deadline = time.monotonic() + PEER_WAIT_S
            while not (self.staging / jobdir.COMPLETE).is_file():
                if time.monotonic() > deadline:
                    raise Failure("peer_lost", "PeerError", "rank 0 did not complete", exitcodes.PEER_LOST)
                self.sleep_until(time.monotonic() + SLICE_S)
            return
        self.write_staging(after)
        self.flag.check()  # a signal that arrived by now must never publish
        digest = hashlib.sha256((self.staging / jobdir.MANIFEST).read_bytes()).hexdigest()
        ckpt.write_durable(self.staging / jobdir.COMPLETE, f"manifest sha256:{digest}\n".encode())
        ckpt.fsync_dir(self.staging)
        if self.flag.signum == signal.SIGTERM:
            (self.staging / jobdir.COMPLETE).unlink()
            ckpt.fsync_dir(self.staging)
            self.flag.check()

    def write_staging(self, after: dict[str, Any]) -> None:
        """Every file of the staging directory but COMPLETE, each fsynced (as ``Recipe._write_staging``)."""
        from importlib import metadata  # lazy: ~4 MB of RSS, needed once at the very end

        self.staging.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.staging.exists():
            ckpt.remove_dir(self.staging)
        self.staging.mkdir(mode=0o700)
        hp, spec = self.hp, self.spec
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": spec["base_model"]["name"],
                  "r": hp["lora_r"], "lora_alpha": hp["lora_alpha"], "lora_dropout": hp["lora_dropout"],
                  "target_modules": list(MODULES), "bias": "none", "inference_mode": True}
        evals = {"before": next(e for e in self.evals if e["when"] == "before"), "after": after,
                 "during": [e for e in self.evals if e["when"] == "step"],
                 "validation": "file" if spec.get("validation") else "holdout",
                 "best_step": None, "best_loss": None, "stopped_early": False}
        metrics = "".join(json.dumps({k: m[k] for k in ("step", "loss", "lr", "tokens_per_s", "elapsed_s", "tokens")})
                          + "\n" for m in self.metrics)
        files = {"adapter_model.safetensors": adapter(hp["lora_r"], self.step, peft_names=True),
                 "adapter_config.json": json.dumps(config, indent=1).encode(),
                 jobdir.EVAL: json.dumps(evals, indent=1).encode(), jobdir.METRICS: metrics.encode()}
        for name, data in files.items():
            ckpt.write_durable(self.staging / name, data)
        try:
            ours = metadata.version("slurm-finetune")
        except metadata.PackageNotFoundError:
            ours = "not installed"
        versions = {"python": platform.python_version(), "slurm-finetune": ours,
                    **{lib: "simulated" for lib in ("torch", "transformers", "peft", "bitsandbytes", "safetensors")}}
        validation = spec.get("validation")
        manifest = {
            "files": {n: "sha256:" + hashlib.sha256(d).hexdigest() for n, d in sorted(files.items())},
            "base_model": {"name": spec["base_model"]["name"], "digest": spec["base_model"]["digest"]},
            "datasets": {"train": spec["train"].get("sha256"), "validation": validation.get("sha256") if validation
                         else None},
            "spec_hash": None, "method": spec["method"], "attempt": self.attempt, "steps": self.step,
            "best_step": None, "train_seconds": round(self.elapsed, 3), "world_size": self.size,
            "fsdp": bool(spec["fsdp"]), "versions": versions, "simulated": True,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        }
        ckpt.write_durable(self.staging / jobdir.MANIFEST, json.dumps(manifest, indent=1).encode())
        ckpt.fsync_dir(self.staging)

    def stopped(self, s: Stop) -> int:
        """Checkpoint what was trained (once planned) and record the stop, as ``recipe._stop``."""
        if self.plan is not None:
            self.save_checkpoint()
        waited = time.monotonic() - self.flag.received_at if self.flag.received_at else None
        self.events.emit("stopped", signal=signal.Signals(s.signum).name, exit_code=s.exit_code, step=self.step,
                         checkpoint_step=self.last_checkpoint if self.last_checkpoint > 0 else None,
                         signal_to_exit_s=round(waited, 3) if waited is not None else None)
        log.info("%s: stopped at step %d, exit %d", signal.Signals(s.signum).name, self.step, s.exit_code)
        return s.exit_code


def positive(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m trainer.simulate", description=__doc__.splitlines()[0])
    parser.add_argument("spec_path", type=Path)
    parser.add_argument("--speedup", type=positive, default=1.0, help="simulated time runs this much faster")
    parser.add_argument("--tokens-per-s", type=positive, default=TOKENS_PER_S, help="simulated tokens/s per GPU")
    parser.add_argument("--seconds", type=positive, default=None, help="training time outright (wall seconds)")
    parser.add_argument("--fail-at-step", type=int, default=None, help="fail (exit INTERNAL) after this step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one attempt on this rank; return the exit code (``trainer.contract.exitcodes``)."""
    flag = Flag()
    signal.signal(signal.SIGUSR1, flag.handle)
    signal.signal(signal.SIGTERM, flag.handle)
    args = parse_args(argv)
    try:
        rank, size, _, _ = jobenv.world_env()
        attempt = jobenv.attempt_number()
    except ValueError as e:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        log.error("%s", e)
        return exitcodes.INTERNAL
    prefix = f"rank {rank}/{size} " if size > 1 else ""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s")
    try:
        spec = read_spec(args.spec_path)
    except (OSError, ValueError, TypeError) as e:
        log.error("invalid job spec %s: %s", args.spec_path, e)
        return exitcodes.USER_ERROR
    try:
        code = Simulation(spec, attempt, rank, size, flag, args).run()
    except OSError as e:  # e.g. job_dir not writable: nothing else can be reported
        log.error("cannot use job_dir %s: %s", spec["job_dir"], e.strerror)
        code = exitcodes.INTERNAL
    log.info("simulated attempt %d: exit %d, peak RSS %s kB", attempt, code, peak_rss_kb())
    return code


def peak_rss_kb() -> int | None:
    """This process's peak RSS (``VmHWM``; ``ru_maxrss`` would count a parent's pages from before exec)."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
