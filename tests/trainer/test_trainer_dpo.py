"""DPO on the tiny model: the loss against a direct formula, the reference policy, learning on
held-out pairs, SIGKILL + exact resume, cancel, and a chat file given to a DPO job."""

from __future__ import annotations

import json
import math
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import (
    CANARY,
    Reference,
    Tiny,
    ToyData,
    assert_same_run,
    events,
    losses,
    make_spec,
    run_trainer,
    start_trainer,
    wait_for,
    write_spec,
)

from trainer.contract import exitcodes

pytestmark = pytest.mark.train

BETA = 0.1


@pytest.fixture(scope="module")
def prefs(tmp_path_factory: pytest.TempPathFactory) -> ToyData:
    """Toy preference train/validation files; the train file carries a canary in prompts and both sides."""
    from trainer.data import sha256_file
    from trainer.toydata import toy_preferences, write_jsonl

    base = tmp_path_factory.mktemp("prefs")
    rows = toy_preferences(160, seed=1)
    for i in (2, 40, 99):
        rows[i]["input"]["messages"][-1]["content"] += f" {CANARY}"
        rows[i]["preferred_output"][0]["content"] += f" {CANARY}"
        rows[i]["non_preferred_output"][0]["content"] += f" {CANARY}"
    train = write_jsonl(base / "train.jsonl", rows)
    val = write_jsonl(base / "val.jsonl", toy_preferences(40, seed=2))
    return ToyData(train, sha256_file(train), val, sha256_file(val))


def dpo_spec(tiny: Tiny, prefs: ToyData, job_dir: Path, **hyper: Any) -> dict[str, Any]:
    """A small DPO spec: 2 epochs of 160 pairs, steps of whole pairs (<= 768 tokens)."""
    spec = make_spec(tiny, prefs, job_dir, batch_size_tokens=768, max_seq_len=256, beta=BETA, **hyper)
    spec["method"] = "dpo"
    spec["hyperparameters"].pop("lora_dropout")   # DPO trains without dropout (a non-zero value is refused)
    return spec


@pytest.fixture(scope="module")
def dpo_reference(tiny: Tiny, prefs: ToyData, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """One uninterrupted DPO run, compared against by the resume tests."""
    base = tmp_path_factory.mktemp("dpo-reference")
    spec = dpo_spec(tiny, prefs, base / "job")
    log = base / "trainer.log"
    t0 = time.monotonic()
    rc = run_trainer(write_spec(spec, base / "spec.json"), log)
    return Reference(spec, base / "job", base / "job" / "attempts" / "0" / "staging", log, rc,
                     time.monotonic() - t0)


def _pairs(tiny: Tiny, path: Path) -> list[Any]:
    from transformers import AutoTokenizer

    from trainer.dpo import read_pairs, tokenize_pairs

    return tokenize_pairs(AutoTokenizer.from_pretrained(tiny.path), read_pairs(path, "validation"), 256, "validation")


@pytest.fixture
def lora_model(tiny: Tiny) -> Any:
    """The tiny 4-bit base with a fresh LoRA adapter (no dropout), in this process."""
    from trainer.contract.spec import Hyperparameters
    from trainer.model import add_lora, load_base_model

    hp = Hyperparameters(lora_r=8, lora_alpha=16, lora_dropout=0.0, batch_size_tokens=512, max_seq_len=256,
                         gradient_checkpointing=False)
    return add_lora(load_base_model(tiny.path), hp)


def _perturb(model: Any, seed: int = 1) -> None:
    """Non-zero LoRA B, so the policy differs from the base and every LoRA matrix gets a gradient."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)


def _direct_logp(model: Any, example: Any) -> Any:
    """The summed log-probability of an example's trained tokens from one plain full-logits forward."""
    import torch

    ids = torch.tensor([example.input_ids])
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    logps = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(example.loss_mask[1:], dtype=torch.bool)
    return logps[mask].sum()


def test_packed_pair_logps_equal_each_sequence_alone(lora_model: Any, tiny: Tiny, prefs: ToyData) -> None:
    import torch

    from trainer.dpo import pair_rows
    from trainer.model import row_logps

    _perturb(lora_model)
    pairs = _pairs(tiny, prefs.val)[:5]
    (row,) = pair_rows(pairs, list(range(5)), 4096)
    lora_model.eval()
    with torch.no_grad():
        packed = row_logps(lora_model, row.row).view(-1, 2)
        alone = torch.stack([torch.stack([_direct_logp(lora_model, p.chosen), _direct_logp(lora_model, p.rejected)])
                             for p in pairs])
    print(f"\npacked {packed[:2].tolist()} vs alone {alone[:2].tolist()}")
    assert torch.allclose(packed, alone, rtol=1e-5, atol=1e-4)


def test_dpo_gradients_equal_the_direct_formula(lora_model: Any, tiny: Tiny, prefs: ToyData) -> None:
    """Rows of whole pairs, accumulated: the gradients of mean(-log sigmoid(beta * margin)) over the
    step's pairs, computed the plain way (one forward per sequence, full logits)."""
    import torch
    import torch.nn.functional as F

    from trainer.dpo import accumulate_pair_gradients, pair_rows

    pairs = _pairs(tiny, prefs.val)[:6]
    reference = torch.randn(len(pairs), 2, generator=torch.Generator().manual_seed(3)) - 20.0
    _perturb(lora_model)
    lora_model.train()
    params = {n: p for n, p in lora_model.named_parameters() if p.requires_grad}
    rows = pair_rows(pairs, list(range(6)), 400)  # several rows, whole pairs each
    assert len(rows) > 1 and sorted(i for r in rows for i in r.pairs) == list(range(6))
    sums = accumulate_pair_gradients(lora_model, rows, len(pairs), reference, BETA)
    ours = {n: p.grad.detach().clone() for n, p in params.items()}
    lora_model.zero_grad(set_to_none=True)

    policy = torch.stack([torch.stack([_direct_logp(lora_model, p.chosen), _direct_logp(lora_model, p.rejected)])
                          for p in pairs])
    z = BETA * ((policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1]))
    loss = -F.logsigmoid(z).mean()
    loss.backward()
    print(f"\nstep loss {sums.loss / sums.pairs:.6f} vs direct {float(loss.detach()):.6f} over {len(rows)} rows")
    assert sums.pairs == 6 and sums.loss / 6 == pytest.approx(float(loss.detach()), rel=1e-5)
    for name, p in params.items():
        assert torch.allclose(ours[name], p.grad, rtol=1e-4, atol=1e-7), name
    lora_model.zero_grad(set_to_none=True)


def test_reference_is_the_base_without_a_second_model(lora_model: Any, tiny: Tiny, prefs: ToyData) -> None:
    """The precomputed reference (the fresh LoRA model) equals the trained model with its adapter disabled."""
    import torch

    from trainer.dpo import pair_rows, reference_logps

    pairs = _pairs(tiny, prefs.val)[:8]
    rows = pair_rows(pairs, list(range(8)), 512)
    reference = reference_logps(lora_model, rows, len(pairs))
    _perturb(lora_model)  # "training"
    moved = reference_logps(lora_model, rows, len(pairs))
    with lora_model.disable_adapter():
        base = reference_logps(lora_model, rows, len(pairs))
    assert not torch.allclose(moved, reference)
    assert torch.allclose(base, reference, rtol=1e-6, atol=1e-5)


def test_dpo_run_raises_heldout_preference_accuracy_and_reward_margin(dpo_reference: Reference) -> None:
    assert dpo_reference.rc == 0, dpo_reference.log.read_text()[-3000:]
    evals = json.loads((dpo_reference.staging / "eval.json").read_text())
    before, after = evals["before"], evals["after"]
    print(f"\nDPO run {dpo_reference.seconds:.1f} s; held-out: loss {before['loss']:.3f} -> {after['loss']:.3f}, "
          f"reward accuracy {before['reward_accuracy']:.2f} -> {after['reward_accuracy']:.2f}, margin "
          f"{before['reward_margin']:.3f} -> {after['reward_margin']:.3f}, log-prob accuracy "
          f"{before['logp_accuracy']:.2f} -> {after['logp_accuracy']:.2f}")
    # before: the policy is the reference: every pair ties
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert before["reward_margin"] == 0 and before["reward_accuracy"] == 0.5
    assert after["reward_accuracy"] >= 0.9 and after["reward_margin"] > 0.5 and after["loss"] < 0.3
    assert after["logp_accuracy"] >= before["logp_accuracy"]
    assert after["pairs"] == before["pairs"] == 40
    steps = [e for e in events(dpo_reference.job_dir) if e["type"] == "metrics"]
    assert steps and all({"reward_margin", "reward_accuracy"} <= e.keys() for e in steps)
    manifest = json.loads((dpo_reference.staging / "manifest.json").read_text())
    assert manifest["method"] == "dpo"
    phases = [e["phase"] for e in events(dpo_reference.job_dir) if e["type"] == "phase"]
    assert phases[:3] == ["tokenizing", "reference", "evaluating"]


def test_dpo_logs_events_and_metrics_never_hold_dataset_text(dpo_reference: Reference) -> None:
    for path in [dpo_reference.log, dpo_reference.job_dir / "events.jsonl",
                 *dpo_reference.staging.glob("*.json*")]:
        assert CANARY not in path.read_text(errors="replace"), path


def test_dpo_sigkill_then_resume_is_exact(dpo_reference: Reference, tiny: Tiny, prefs: ToyData,
                                          tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    spec_path = write_spec(dpo_spec(tiny, prefs, job_dir), tmp_path / "spec.json")
    log = tmp_path / "trainer.log"
    total = len(losses(dpo_reference.staging))
    rng = random.Random(20261202)
    done = 0
    for upper in (total // 3, total - 4):
        offset = len(events(job_dir))
        proc = start_trainer(spec_path, log)
        target = rng.randint(done + 5, max(done + 5, upper))

        def reached(offset: int = offset, target: int = target) -> bool:
            return max((e["step"] for e in events(job_dir)[offset:] if e["type"] == "metrics"), default=0) >= target

        assert wait_for(reached, 120)
        proc.kill()
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        done = max(done, target)
        print(f"\nSIGKILL at step >= {target}")
    assert run_trainer(spec_path, log) == 0, log.read_text()[-3000:]
    resumed = [e["resumed_from_step"] for e in events(job_dir) if "resumed_from_step" in e]
    print(f"resumed from steps {resumed}")
    assert_same_run(job_dir / "attempts" / "0" / "staging", dpo_reference.staging)
    # every kill came after a checkpoint (step 4): each resume scored against the checkpoint's
    # reference; only the first start computed it
    assert len(resumed) == 2
    assert [e["phase"] for e in events(job_dir) if e["type"] == "phase"].count("reference") == 1


def test_dpo_sigterm_stops_within_a_step_exits_143_never_complete(tiny: Tiny, prefs: ToyData,
                                                                  tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    spec = dpo_spec(tiny, prefs, job_dir)
    spec["checkpoint_every_steps"] = 1000
    proc = start_trainer(write_spec(spec, tmp_path / "spec.json"), tmp_path / "trainer.log")
    assert wait_for(lambda: any(e["type"] == "metrics" and e["step"] >= 3 for e in events(job_dir)), 120)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == exitcodes.CANCELLED == 143
    stopped = next(e for e in events(job_dir) if e["type"] == "stopped")
    assert stopped["checkpoint_step"] == stopped["step"] >= 3
    assert not list(job_dir.glob("attempts/*/staging/COMPLETE"))


def test_a_chat_file_given_to_a_dpo_job_fails_fast_naming_the_line(tiny: Tiny, toy: ToyData,
                                                                   tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    spec = make_spec(tiny, toy, job_dir, batch_size_tokens=768, max_seq_len=256)
    spec["method"] = "dpo"
    spec["hyperparameters"].pop("lora_dropout")
    log = tmp_path / "trainer.log"
    assert run_trainer(write_spec(spec, tmp_path / "spec.json"), log) == exitcodes.USER_ERROR
    failed = next(e for e in events(job_dir) if e["type"] == "failed")
    assert failed["reason"] == "user_error" and "train dataset line 1:" in failed["message"]
    assert "input" in failed["message"]  # what a preference line must hold
