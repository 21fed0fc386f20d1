"""Data parallelism's pure pieces: ranks from the environment, the world-size rule, one rank = no-ops."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from trainer_testlib import REPO, trainer_env

from trainer.contract.errors import LaunchError, SpecError
from trainer.contract.spec import parse_spec, spec_hash
from trainer.distributed import World, dropout_seed
from trainer.events import EventLog
from trainer.jobenv import dist_timeout_s, world_env

pytestmark = pytest.mark.unit

_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _set(env: pytest.MonkeyPatch, **values: str) -> None:
    for name, value in values.items():
        env.setenv(name, value)


def test_ranks_come_from_torch_names_then_slurm_then_one_process(env: pytest.MonkeyPatch) -> None:
    assert world_env() == (0, 1, 0, "neither WORLD_SIZE nor SLURM_NTASKS is set")
    _set(env, SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1")
    assert world_env() == (5, 8, 1, "SLURM_NTASKS")
    _set(env, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")  # the torch names win
    assert world_env() == (1, 2, 1, "WORLD_SIZE")


def test_a_batch_script_without_srun_is_one_process(env: pytest.MonkeyPatch) -> None:
    _set(env, SLURM_NTASKS="1")  # no SLURM_PROCID/SLURM_LOCALID needed with one task
    assert world_env() == (0, 1, 0, "SLURM_NTASKS")


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"WORLD_SIZE": "two", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE must be an integer, got 'two'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1, got 0"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}, "RANK must be in [0, 2) (WORLD_SIZE=2), got 2"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK is not set: every rank of a run of several needs it"),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "3"}, "SLURM_LOCALID is not set"),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "-1"}, "SLURM_LOCALID must be >= 0"),
    ],
)
def test_invalid_rank_variables_are_named(env: pytest.MonkeyPatch, values: dict[str, str], problem: str) -> None:
    _set(env, **values)
    with pytest.raises(ValueError) as e:
        world_env()
    assert problem in str(e.value)


def test_collective_timeout_can_be_shortened(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SFT_DIST_TIMEOUT_S", raising=False)
    assert dist_timeout_s(300.0) == 300.0
    monkeypatch.setenv("SFT_DIST_TIMEOUT_S", "12.5")
    assert dist_timeout_s(300.0) == 12.5
    monkeypatch.setenv("SFT_DIST_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="SFT_DIST_TIMEOUT_S must be > 0"):
        dist_timeout_s(300.0)


def test_a_launch_of_another_size_is_refused_naming_the_variable() -> None:
    World(0, 2, 0, "SLURM_NTASKS").check_size(2)
    with pytest.raises(LaunchError, match=r"^spec asks for 4 ranks, this run has 2 \(SLURM_NTASKS\)"):
        World(0, 2, 0, "SLURM_NTASKS").check_size(4)


def test_several_ranks_need_rank_0s_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(LaunchError, match=r"^MASTER_ADDR unset: a run of 2 ranks needs rank 0's address"):
        World(1, 2, 1, "WORLD_SIZE").connect("cpu")


def test_one_process_needs_no_torch_distributed() -> None:
    """World() helpers return their input at once; torch is not even imported (today's cost)."""
    code = (
        "import sys; from trainer.distributed import World; w = World(); w.select_gpu('auto'); w.connect('cpu');"
        "assert w.sum_floats([1.5, 2]) == [1.5, 2] and w.agree_stop(10) == 10 and w.agree_stop(None) is None;"
        "assert w.all_equal(3) and w.is_main; w.sum_gradients([]); w.barrier(); w.close();"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=trainer_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_dropout_seeds_differ_by_rank_and_step_and_repeat() -> None:
    seeds = {dropout_seed(0, rank, step) for rank in range(4) for step in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert dropout_seed(7, 1, 3) == dropout_seed(7, 1, 3) != dropout_seed(8, 1, 3)


def test_muted_event_log_creates_no_file(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", 0, "job", write=False)
    assert log.emit("phase", phase="training")["type"] == "phase"
    log.close()
    assert not (tmp_path / "events.jsonl").exists()


def _spec(**top: object) -> dict[str, object]:
    return {
        "base_model": {"name": "tiny", "digest": "sha256:" + "a" * 64, "catalog_root": "/models"},
        "train": {"path": "/d/train.jsonl", "sha256": "b" * 64},
        "job_dir": "/jobs/1",
        **top,
    }


def test_world_size_is_in_range_and_hashed_only_when_set() -> None:
    assert parse_spec(_spec()).world_size == 1
    assert spec_hash(parse_spec(_spec(world_size=1))) == spec_hash(parse_spec(_spec()))  # in-flight jobs
    assert spec_hash(parse_spec(_spec(world_size=2))) != spec_hash(parse_spec(_spec()))
    for bad in (0, 1025):
        with pytest.raises(SpecError, match=r"world_size: .*\(allowed range: 1 <= world_size <= 1024\)"):
            parse_spec(_spec(world_size=bad))


def test_fsdp_is_hashed_only_when_set() -> None:
    assert parse_spec(_spec()).fsdp is False
    assert spec_hash(parse_spec(_spec(fsdp=False))) == spec_hash(parse_spec(_spec()))  # in-flight jobs
    assert spec_hash(parse_spec(_spec(fsdp=True))) != spec_hash(parse_spec(_spec()))


def _raised_in(filename: str, message: str) -> RuntimeError:
    try:
        exec(compile(f"raise RuntimeError({message!r})", filename, "exec"))  # noqa: S102 - a frame with that name
    except RuntimeError as e:
        return e
    raise AssertionError("not raised")


def test_a_lost_peer_is_a_transport_error_raised_in_torch_distributed_only() -> None:
    from trainer.distributed import _lost_peer

    c10d = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    assert _lost_peer(_raised_in(c10d, "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]"))
    assert _lost_peer(_raised_in(c10d, "Timed out waiting 30000ms for recv operation to complete"))
    assert not _lost_peer(_raised_in(c10d, "Cannot use ReduceOp.PREMUL_SUM with Gloo"))  # a bug, not a peer
    # the same words from model code (say, a tenant's data in a message) are not a peer
    assert not _lost_peer(_raised_in("/venv/lib/python3.11/site-packages/transformers/x.py", "Connection closed"))


def test_one_rank_not_sharded_never_touches_torch_distributed() -> None:
    world = World()
    world.connect("cpu")
    assert world._dist is None and not world.sharded
    with world.collectives("anything"):  # no-op outside FSDP
        pass


def test_a_checkpoint_is_pinned_to_the_spec_not_to_its_layout_over_ranks() -> None:
    from trainer.contract.spec import checkpoint_hash

    plain = parse_spec(_spec())
    assert checkpoint_hash(plain) == spec_hash(plain)  # one process: checkpoints written before it still match
    for layout in ({"world_size": 4}, {"world_size": 2, "fsdp": True}, {"fsdp": True}):
        assert checkpoint_hash(parse_spec(_spec(**layout))) == checkpoint_hash(plain), layout
    other = parse_spec(_spec(hyperparameters={"learning_rate": 1e-3}))
    assert checkpoint_hash(other) != checkpoint_hash(plain)


def test_the_compute_dtype_is_bfloat16_on_cuda_only_and_fsdp_stages_on_the_cpu() -> None:
    import torch

    from trainer.model import compute_dtype, staging_device

    assert compute_dtype("cuda") == torch.bfloat16 and compute_dtype("cpu") == torch.float32
    assert staging_device("cuda", shardable=True) == "cpu"  # FSDP: World.shard moves each layer to the GPU
    assert staging_device("cuda", shardable=False) == "cuda" and staging_device("cpu", shardable=True) == "cpu"
