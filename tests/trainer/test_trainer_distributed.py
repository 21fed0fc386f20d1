"""Data parallel over real processes (gloo on the CPU, no Slurm): 2 ranks vs 1, a dead rank, signals.

Each rank is ``python -m trainer run spec.json`` with RANK/WORLD_SIZE/LOCAL_RANK
and MASTER_ADDR/MASTER_PORT, as srun's tasks would be (with SLURM_* instead).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import (
    Tiny,
    ToyData,
    adapter,
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

STEPS = 12
TIMEOUT_S = 30  # SFT_DIST_TIMEOUT_S: how long a rank waits for a dead one (gloo notices at once anyway)
LOSS_RTOL = 1e-4  # 1 vs 2 ranks: the same sums in another order (measured ~1e-7)
ADAPTER_TOL = 1e-3  # per tensor, relative to its largest entry, after STEPS Adam steps (measured below)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spec(tiny: Tiny, toy: ToyData, job_dir: Path, world_size: int, dropout: float) -> dict[str, Any]:
    # steps of ~8 rows of <= 120 tokens: each rank accumulates several rows (another summation order than
    # one process's), and the 21 validation rows do not split evenly
    spec = make_spec(tiny, toy, job_dir, lora_dropout=dropout, max_steps=STEPS, eval_every_steps=4,
                     batch_size_tokens=960, max_seq_len=120)
    spec["world_size"] = world_size
    spec["checkpoint_every_steps"] = 3
    return spec


def _start_ranks(spec_path: Path, logs: Path, size: int, attempt: int | None = None) -> list[subprocess.Popen[bytes]]:
    port = str(_free_port())
    return [
        start_trainer(spec_path, logs / f"rank{rank}.log", attempt, env={
            "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "SFT_DIST_TIMEOUT_S": str(TIMEOUT_S),
        })
        for rank in range(size)
    ]


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float = 180) -> list[int]:
    return [p.wait(timeout=timeout) for p in procs]


def _tail(logs: Path) -> str:
    return "\n".join(p.read_text()[-2000:] for p in sorted(logs.glob("rank*.log")))


@dataclass(frozen=True)
class Run:
    job_dir: Path
    spec_path: Path
    staging: Path
    seconds: float


def _run(tmp: Path, spec: dict[str, Any]) -> Run:
    """Run ``spec`` to its end with ``spec["world_size"]`` ranks (one plain process for 1)."""
    spec_path = write_spec(spec, tmp / "spec.json")
    t0 = time.monotonic()
    if spec["world_size"] == 1:
        codes = [run_trainer(spec_path, tmp / "rank0.log")]
    else:
        codes = _wait(_start_ranks(spec_path, tmp, spec["world_size"]))
    seconds = time.monotonic() - t0
    assert codes == [0] * spec["world_size"], _tail(tmp)
    job_dir = Path(spec["job_dir"])
    return Run(job_dir, spec_path, job_dir / "attempts" / "0" / "staging", seconds)


@pytest.fixture(scope="module")
def one_rank(tiny: Tiny, toy: ToyData, tmp_path_factory: pytest.TempPathFactory) -> Run:
    base = tmp_path_factory.mktemp("one-rank")
    return _run(base, _spec(tiny, toy, base / "job", 1, dropout=0.0))


@pytest.fixture(scope="module")
def two_ranks(tiny: Tiny, toy: ToyData, tmp_path_factory: pytest.TempPathFactory) -> Run:
    base = tmp_path_factory.mktemp("two-ranks")
    return _run(base, _spec(tiny, toy, base / "job", 2, dropout=0.0))


@pytest.fixture(scope="module")
def two_ranks_dropout(tiny: Tiny, toy: ToyData, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """An uninterrupted 2-rank run with dropout (per-rank masks): what interrupted runs must equal exactly."""
    base = tmp_path_factory.mktemp("two-ranks-dropout")
    return _run(base, _spec(tiny, toy, base / "job", 2, dropout=0.1))



@pytest.fixture(scope="module")
def two_ranks_fsdp(tiny: Tiny, toy: ToyData, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """2 ranks sharding the 4-bit base, LoRA and Adam state (FSDP2 over gloo)."""
    base = tmp_path_factory.mktemp("two-ranks-fsdp")
    spec = _spec(tiny, toy, base / "job", 2, dropout=0.0)
    spec["fsdp"] = True
    return _run(base, spec)


def _files(job_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(job_dir)) for p in job_dir.rglob("*"))


def _same_as_one_process(one_rank: Run, other: Run, label: str) -> None:
    """``other`` trained as one process did: steps, losses, adapter, final eval; one writer, same files."""
    one, two = losses(one_rank.staging), losses(other.staging)
    assert [s for s, _ in one] == [s for s, _ in two] == list(range(1, STEPS + 1))
    loss_diff = max(abs(a - b) / abs(a) for (_, a), (_, b) in zip(one, two, strict=True))
    mine, theirs = adapter(other.staging), adapter(one_rank.staging)
    assert mine.keys() == theirs.keys()
    adapter_diff = {n: float((mine[n] - theirs[n]).abs().max() / theirs[n].abs().max().clamp_min(1e-12))
                    for n in mine}
    evals = [json.loads((r.staging / "eval.json").read_text()) for r in (one_rank, other)]
    eval_diff = abs(evals[0]["after"]["loss"] - evals[1]["after"]["loss"]) / evals[0]["after"]["loss"]
    print(f"\n1 rank {one_rank.seconds:.1f} s, {label} {other.seconds:.1f} s; {STEPS} steps: worst relative "
          f"difference of the step losses {loss_diff:.2e}, of the adapter tensors {max(adapter_diff.values()):.2e} "
          f"({len(mine)} tensors), of the final eval loss {eval_diff:.2e}")
    assert loss_diff <= LOSS_RTOL and eval_diff <= LOSS_RTOL
    assert max(adapter_diff.values()) <= ADAPTER_TOL, adapter_diff
    assert evals[0]["after"]["tokens"] == evals[1]["after"]["tokens"]  # every validation row counted once
    # rank 1 wrote nothing: the same events (one writer) and the same files as the single process
    kinds = [[e["type"] for e in events(r.job_dir)] for r in (one_rank, other)]
    assert kinds[0] == kinds[1] and kinds[0][-1] == "done"
    assert _files(one_rank.job_dir) == _files(other.job_dir)


def test_two_ranks_train_as_one_process_and_only_rank_0_writes(one_rank: Run, two_ranks: Run) -> None:
    _same_as_one_process(one_rank, two_ranks, "2 ranks")


def test_two_ranks_sharded_with_fsdp_train_as_one_process(one_rank: Run, two_ranks_fsdp: Run) -> None:
    """FSDP2 over 2 ranks: the steps, losses and adapter of one process; one writer; the same checkpoint format."""
    import torch
    from safetensors.torch import load_file

    _same_as_one_process(one_rank, two_ranks_fsdp, "2 FSDP ranks")
    # the checkpoints hold whole tensors in the unsharded layout: gathered, not one rank's shard
    newest = max((two_ranks_fsdp.job_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    ref = one_rank.job_dir / "checkpoints" / newest.name
    got, want = load_file(newest / "adapter.safetensors"), load_file(ref / "adapter.safetensors")
    assert {n: t.shape for n, t in got.items()} == {n: t.shape for n, t in want.items()}
    state = [torch.load(d / "state.pt", weights_only=True)["optimizer"] for d in (newest, ref)]
    assert state[0]["state"].keys() == state[1]["state"].keys()
    assert all(state[0]["state"][i]["exp_avg"].shape == state[1]["state"][i]["exp_avg"].shape
               for i in state[1]["state"])


def test_fsdp_sigusr1_checkpoints_gathered_state_and_the_requeued_run_resumes_exactly(
    two_ranks_fsdp: Run, tiny: Tiny, toy: ToyData, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    spec = _spec(tiny, toy, job_dir, 2, dropout=0.0)
    spec["fsdp"] = True
    spec["checkpoint_every_steps"] = 1000  # the checkpoint must come from the signal
    spec_path = write_spec(spec, tmp_path / "spec.json")
    procs = _start_ranks(spec_path, tmp_path, 2)
    assert wait_for(lambda: _step(job_dir) >= 3, 120), _tail(tmp_path)
    for p in procs:
        p.send_signal(signal.SIGUSR1)
    codes = _wait(procs, timeout=60)
    stopped = [e for e in events(job_dir) if e["type"] == "stopped"]
    checkpoints = sorted(p.name for p in (job_dir / "checkpoints").iterdir())
    print(f"\nFSDP, SIGUSR1 to both: exits {codes}, stopped at {[e['step'] for e in stopped]}, "
          f"checkpoints {checkpoints}")
    assert codes == [exitcodes.REQUEUE, exitcodes.REQUEUE], _tail(tmp_path)
    assert checkpoints == [f"step-{stopped[0]['step']}"]
    assert _wait(_start_ranks(spec_path, tmp_path, 2, attempt=1)) == [0, 0], _tail(tmp_path)
    resumed = [e["resumed_from_step"] for e in events(job_dir) if "resumed_from_step" in e]
    assert resumed == [stopped[0]["step"]]
    assert_same_run(job_dir / "attempts" / "1" / "staging", two_ranks_fsdp.staging)


def test_a_checkpoint_of_2_fsdp_ranks_resumes_in_one_process_as_if_it_had_run_there(
    one_rank: Run, tiny: Tiny, toy: ToyData, tmp_path: Path
) -> None:
    """Steps, data order and the checkpoint format do not depend on the layout: a job stopped on
    2 sharded ranks continues on 1 unsharded process and ends where 1 process alone ends."""
    job_dir = tmp_path / "job"
    spec = _spec(tiny, toy, job_dir, 2, dropout=0.0)
    spec["fsdp"] = True
    spec["checkpoint_every_steps"] = 1000
    procs = _start_ranks(write_spec(spec, tmp_path / "spec-2.json"), tmp_path, 2)
    assert wait_for(lambda: _step(job_dir) >= 4, 120), _tail(tmp_path)
    for p in procs:
        p.send_signal(signal.SIGUSR1)
    assert _wait(procs, timeout=60) == [exitcodes.REQUEUE] * 2, _tail(tmp_path)
    stopped = next(e for e in events(job_dir) if e["type"] == "stopped")["step"]
    alone = {**spec, "world_size": 1, "fsdp": False}
    assert run_trainer(write_spec(alone, tmp_path / "spec-1.json"), tmp_path / "rank0.log", attempt=1) == 0
    resumed = [e["resumed_from_step"] for e in events(job_dir) if "resumed_from_step" in e]
    staging = job_dir / "attempts" / "1" / "staging"
    mine, theirs = losses(staging), losses(one_rank.staging)
    assert [s for s, _ in mine] == [s for s, _ in theirs]
    loss_diff = max(abs(a - b) / abs(a) for (_, a), (_, b) in zip(theirs, mine, strict=True))
    got, want = adapter(staging), adapter(one_rank.staging)
    adapter_diff = max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)) for n in want)
    print(f"\n2 FSDP ranks stopped at step {stopped}, 1 process resumed from {resumed} to step {STEPS}: vs 1 "
          f"process throughout, worst relative step-loss difference {loss_diff:.2e}, adapter {adapter_diff:.2e}")
    assert resumed == [stopped] and 4 <= stopped < STEPS
    assert loss_diff <= LOSS_RTOL and adapter_diff <= ADAPTER_TOL


def test_fsdp_refuses_trainable_parameters_outside_the_decoder_layers(tiny: Tiny, toy: ToyData,
                                                                     tmp_path: Path) -> None:
    """One rank, FSDP over a process group of one: a LoRA on lm_head (not sharded) is refused at start."""
    job_dir = tmp_path / "job"
    spec = _spec(tiny, toy, job_dir, 1, dropout=0.0)
    spec["fsdp"] = True
    spec["hyperparameters"]["target_modules"] = ["q_proj", "lm_head"]
    rc = run_trainer(write_spec(spec, tmp_path / "spec.json"), tmp_path / "rank0.log")
    failed = [e for e in events(job_dir) if e["type"] == "failed"]
    print(f"\nexit {rc}: {failed[0]['message'] if failed else (tmp_path / 'rank0.log').read_text()[-300:]}")
    assert rc == exitcodes.INTERNAL and failed and failed[0]["error"] == "LaunchError"
    assert "fsdp shards the decoder layers only" in failed[0]["message"] and "lm_head" in failed[0]["message"]
    assert not [e for e in events(job_dir) if e["type"] == "metrics"]


def test_fsdp_sigkill_of_rank_1_fails_rank_0_as_peer_lost(tiny: Tiny, toy: ToyData, tmp_path: Path) -> None:
    """A rank dying inside FSDP's gathers (model code, not our collectives) is PEER_LOST too, never a hang."""
    job_dir = tmp_path / "job"
    spec = _spec(tiny, toy, job_dir, 2, dropout=0.0)
    spec["fsdp"] = True
    rank0, rank1 = _start_ranks(write_spec(spec, tmp_path / "spec.json"), tmp_path, 2)
    assert wait_for(lambda: _step(job_dir) >= 2, 120), _tail(tmp_path)
    rank1.kill()
    killed_at = time.monotonic()
    rc = rank0.wait(timeout=TIMEOUT_S + 30)
    seconds = time.monotonic() - killed_at
    failed = [e for e in events(job_dir) if e["type"] == "failed"]
    print(f"\nFSDP, rank 1 SIGKILLed: rank 0 exit {rc} {seconds:.2f} s later: "
          f"{failed[-1]['message'][:160] if failed else '-'}")
    assert rc == exitcodes.PEER_LOST and seconds < TIMEOUT_S + 10, _tail(tmp_path)
    assert failed and failed[-1]["error"] == "PeerError"
    assert not list(job_dir.glob("attempts/*/staging/COMPLETE"))


def _step(job_dir: Path) -> int:
    return max((e["step"] for e in events(job_dir) if e["type"] == "metrics"), default=0)



def test_sigkill_of_rank_1_fails_rank_0_then_a_fresh_run_resumes_exactly(
    two_ranks_dropout: Run, tiny: Tiny, toy: ToyData, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    spec_path = write_spec(_spec(tiny, toy, job_dir, 2, dropout=0.1), tmp_path / "spec.json")
    rank0, rank1 = _start_ranks(spec_path, tmp_path, 2)
    assert wait_for(lambda: _step(job_dir) >= 4, 120), _tail(tmp_path)
    rank1.kill()
    killed_at = time.monotonic()
    rc = rank0.wait(timeout=TIMEOUT_S + 30)
    seconds = time.monotonic() - killed_at
    failed = [e for e in events(job_dir) if e["type"] == "failed"]
    print(f"\nrank 1 SIGKILLed at step >= 4: rank 0 exit {rc} {seconds:.2f} s later, after step {_step(job_dir)}: "
          f"{failed[-1]['message'][:120] if failed else '-'}")
    assert rank1.wait() == -signal.SIGKILL
    assert rc == exitcodes.PEER_LOST and seconds < TIMEOUT_S + 10   # the gang's script requeues on it
    assert failed and failed[-1]["error"] == "PeerError" and failed[-1]["reason"] == "peer_lost"
    assert not list(job_dir.glob("attempts/*/staging/COMPLETE"))  # never published
    saved = sorted(int(p.parent.name.split("-")[1]) for p in job_dir.glob("checkpoints/step-*/COMPLETE"))
    assert saved and saved[-1] >= 3
    assert _wait(_start_ranks(spec_path, tmp_path, 2)) == [0, 0], _tail(tmp_path)
    resumed = [e["resumed_from_step"] for e in events(job_dir) if "resumed_from_step" in e]
    print(f"checkpoints {saved}, resumed from step {resumed}")
    assert resumed == [saved[-1]]
    assert_same_run(job_dir / "attempts" / "0" / "staging", two_ranks_dropout.staging)


def test_sigusr1_stops_both_ranks_at_one_step_with_one_checkpoint_then_requeue_resumes_exactly(
    two_ranks_dropout: Run, tiny: Tiny, toy: ToyData, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    spec = _spec(tiny, toy, job_dir, 2, dropout=0.1)
    spec["checkpoint_every_steps"] = 1000  # the checkpoint must come from the signal
    spec_path = write_spec(spec, tmp_path / "spec.json")
    procs = _start_ranks(spec_path, tmp_path, 2)
    assert wait_for(lambda: _step(job_dir) >= 3, 120), _tail(tmp_path)
    seen = _step(job_dir)
    t0 = time.monotonic()
    for p in procs:  # srun forwards the signal to every task
        p.send_signal(signal.SIGUSR1)
    # bound the stop by the step reported once kill() has returned, not by `seen`: on a loaded machine this
    # process can be descheduled between reading `seen` and the kill for longer than a step (~0.14 s) while
    # the ranks train on. A signal pending when kill() returns runs rank 0's handler before its next Python
    # code, so at the latest the stop check after the first step reported after the kill (<= sent + 1) stops.
    sent = _step(job_dir)
    codes = _wait(procs, timeout=60)
    seconds = time.monotonic() - t0
    stopped = [e for e in events(job_dir) if e["type"] == "stopped"]
    checkpoints = sorted(p.name for p in (job_dir / "checkpoints").iterdir())
    print(f"\nSIGUSR1 to both at step {seen} (step {sent} just after the kill): exits {codes} within "
          f"{seconds:.2f} s, stopped at {[e['step'] for e in stopped]}, checkpoints {checkpoints}")
    assert codes == [exitcodes.REQUEUE, exitcodes.REQUEUE]
    said = [re.findall(r"SIGUSR1: stopped at step (\d+), exit 75", (tmp_path / f"rank{r}.log").read_text())
            for r in (0, 1)]
    assert said[0] == said[1] == [str(stopped[0]["step"])]  # rank 1 (no events of its own) says so in its log
    assert len(stopped) == 1 and stopped[0]["exit_code"] == 75
    assert seen <= stopped[0]["step"] <= sent + 1  # at the first stop check after the signal, at the latest
    assert checkpoints == [f"step-{stopped[0]['step']}"] == [f"step-{stopped[0]['checkpoint_step']}"]
    assert (job_dir / "checkpoints" / checkpoints[0] / "COMPLETE").is_file()
    assert _wait(_start_ranks(spec_path, tmp_path, 2, attempt=1)) == [0, 0], _tail(tmp_path)
    assert_same_run(job_dir / "attempts" / "1" / "staging", two_ranks_dropout.staging)


@pytest.mark.parametrize(
    ("spec_size", "env", "message"),
    [
        (4, {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
         "spec asks for 4 ranks, this run has 2 (SLURM_NTASKS)"),
        (2, {}, "spec asks for 2 ranks, this run has 1 (neither WORLD_SIZE nor SLURM_NTASKS is set)"),
    ],
)
def test_a_launch_of_another_world_size_is_refused(
    spec_size: int, env: dict[str, str], message: str, tiny: Tiny, toy: ToyData, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    log = tmp_path / "rank0.log"
    t0 = time.monotonic()
    rc = run_trainer(write_spec(_spec(tiny, toy, job_dir, spec_size, 0.0), tmp_path / "spec.json"), log, env=env)
    seconds = time.monotonic() - t0
    failed = [e for e in events(job_dir) if e["type"] == "failed"]
    print(f"\nexit {rc} in {seconds:.1f} s: {failed[0]['message'] if failed else log.read_text()[-300:]}")
    assert rc == exitcodes.INTERNAL
    assert message in log.read_text()
    assert failed and failed[0]["error"] == "LaunchError" and failed[0]["message"].startswith(message)
    assert not [e for e in events(job_dir) if e["type"] == "phase"]  # refused before tokenizing
    assert seconds < 15
