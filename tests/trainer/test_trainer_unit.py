"""Fast, pure tests of the trainer's components (no torch, no training)."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
from trainer_testlib import REPO

from trainer import checkpoint as ckpt
from trainer.catalog import add, compute_digest, list_models, resolve
from trainer.contract import exitcodes
from trainer.contract.errors import (
    CatalogError,
    CheckpointError,
    DatasetError,
    GpuUnavailableError,
    ModelDigestError,
    SpecError,
)
from trainer.contract.spec import JobSpec, load_spec, parse_spec, spec_hash
from trainer.data import Conversation, holdout_split, read_conversations
from trainer.events import EventLog, read_events
from trainer.jobenv import attempt_number, real_gpu_allocated
from trainer.model import pick_device
from trainer.packing import (
    IGNORE,
    Example,
    build_row,
    epoch_order,
    mask_from_spans,
    mask_runs,
    micro_batches,
    pack,
    plan,
    sequence_bounds,
)

pytestmark = pytest.mark.unit

DIGEST = "sha256:" + "a" * 64


def _spec(**over: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "base_model": {"name": "tiny", "digest": DIGEST, "catalog_root": "/models"},
        "train": {"path": "/d/train.jsonl", "sha256": "b" * 64},
        "job_dir": "/jobs/1",
    }
    spec.update(over)
    return spec


# ------------------------------------------------------------------ spec


def test_minimal_spec_gets_defaults() -> None:
    spec = parse_spec(_spec())
    assert spec.hyperparameters.target_modules == "all-linear"
    assert spec.validation is None and spec.validation_split == 0.1
    assert spec_hash(spec).startswith("sha256:")


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(_spec(hyperparameters={"lr": 0.1}))
    message = str(e.value)
    assert "hyperparameters.lr: unknown key" in message
    assert "learning_rate" in message and "batch_size_tokens" in message


def test_unknown_top_level_key() -> None:
    with pytest.raises(SpecError, match=r"surprise: unknown key; valid keys here are: base_model"):
        parse_spec(_spec(surprise=1))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("epochs", 0, "1 <= epochs <= 100"),
        ("lora_dropout", 1.0, "0.0 <= lora_dropout < 1.0"),
        ("learning_rate", -1, "0.0 < learning_rate <= 1.0"),
        ("eval_every_steps", 0, "1 <= eval_every_steps"),
    ],
)
def test_out_of_range_names_field_and_range(field: str, value: object, expected: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(_spec(hyperparameters={field: value}))
    assert f"hyperparameters.{field}" in str(e.value) and expected in str(e.value)


def test_seq_len_must_fit_row() -> None:
    with pytest.raises(SpecError, match="max_seq_len .* batch_size_tokens"):
        parse_spec(_spec(hyperparameters={"max_seq_len": 512, "batch_size_tokens": 256}))


def test_bad_digest_and_missing_field() -> None:
    data = _spec(base_model={"name": "tiny", "digest": "md5:x"})
    del data["job_dir"]
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    assert "base_model.digest" in str(e.value) and "job_dir: required" in str(e.value)


def test_load_spec_not_json(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text("{nope")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_spec(tmp_path / "s.json")


def test_spec_module_does_not_import_torch() -> None:
    source = (REPO / "trainer" / "contract" / "spec.py").read_text()
    assert "import torch" not in source
    assert JobSpec.model_fields  # importable by the gateway


# ------------------------------------------------------------------ packing


def _ex(ids: list[int], mask: list[int], line: int = 1) -> Example:
    return Example(tuple(ids), tuple(mask), line)


def test_pack_is_greedy_and_respects_capacity() -> None:
    rows = pack([3, 4, 2, 5, 1], [0, 1, 2, 3, 4], capacity=7)
    assert rows == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError):
        pack([8], [0], capacity=7)


def test_plan_is_deterministic_and_covers_every_example_each_epoch() -> None:
    lengths = [5, 9, 3, 7, 2, 8, 4]
    first, second = plan(lengths, 12, seed=3, epochs=3), plan(lengths, 12, seed=3, epochs=3)
    assert first == second
    for epoch in first:
        assert sorted(i for row in epoch for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 12 for row in epoch)
    assert epoch_order(7, 3, 0) != epoch_order(7, 3, 1)


def test_row_positions_reset_and_targets_stay_inside_examples() -> None:
    a = _ex([10, 11, 12], [0, 1, 1])
    b = _ex([20, 21, 22, 23], [1, 0, 1, 1])
    row = build_row([a, b])
    assert row.input_ids == [10, 11, 12, 20, 21, 22, 23]
    assert row.position_ids == [0, 1, 2, 0, 1, 2, 3]
    # token 12 (last of a) must never learn to predict 20 (first of b)
    assert row.targets == [11, 12, IGNORE, IGNORE, 22, 23, IGNORE]
    assert row.n_targets == 4


def test_micro_batches_split_a_step_into_rows_that_concatenate_to_it() -> None:
    step = [_ex(list(range(10 * i, 10 * i + n)), [0] + [1] * (n - 1), i) for i, n in enumerate([5, 3, 6, 2, 4])]
    rows = micro_batches(step, capacity=8)
    assert [len(r.input_ids) for r in rows] == [8, 8, 4]
    whole = build_row(step)
    assert [t for r in rows for t in r.input_ids] == whole.input_ids
    assert [t for r in rows for t in r.targets] == whole.targets
    assert [p for r in rows for p in r.position_ids] == whole.position_ids
    assert sequence_bounds(rows[0].position_ids) == [0, 5, 8]
    assert sequence_bounds(whole.position_ids) == [0, 5, 8, 14, 16, 20]
    with pytest.raises(ValueError):
        micro_batches(step, capacity=5)


def test_device_choice_refuses_cpu_when_a_gpu_was_promised() -> None:
    assert pick_device("auto", False, "-") == "cpu" and pick_device("auto", True, "-") == "cuda"
    assert pick_device("cpu", True, "-") == "cpu" and pick_device("cuda", True, "-") == "cuda"
    with pytest.raises(GpuUnavailableError, match=r"is False; CUDA_VISIBLE_DEVICES='1'\): refusing to train"):
        pick_device("cuda", False, "CUDA_VISIBLE_DEVICES='1'")
    assert parse_spec(_spec(device="cuda")).device == "cuda" and parse_spec(_spec()).device == "auto"
    with pytest.raises(SpecError, match="device"):
        parse_spec(_spec(device="gpu"))


def test_auto_refuses_the_cpu_when_slurm_gave_a_real_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "auto" on a node whose NVIDIA driver is loaded and where Slurm allocated a GPU: CUDA missing is
    # a broken node or a CPU-only torch, never a reason to train on the CPU; the dev cluster's fake
    # GPUs (device nodes, no driver) keep auto's CPU fallback
    with pytest.raises(GpuUnavailableError, match="refusing to train on the CPU"):
        pick_device("auto", False, "-", gpu_promised=True)
    assert pick_device("auto", True, "-", gpu_promised=True) == "cuda"
    assert pick_device("cpu", False, "-", gpu_promised=True) == "cpu"
    driver = tmp_path / "version"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not real_gpu_allocated(driver)                   # no driver: a fake GPU
    driver.write_text("NVRM version: 550\n")
    assert real_gpu_allocated(driver)
    for unset in ("", "-1", "NoDevFiles"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", unset)
        assert not real_gpu_allocated(driver)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert not real_gpu_allocated(driver)


def test_mask_runs_and_weights() -> None:
    mask = [0, 1, 1, 0, 0, 1, 0, 1]
    assert mask_runs(mask) == [(1, 3), (5, 6), (7, 8)]
    assert mask_from_spans(8, mask_runs(mask), [1, 0, 1]) == [0, 1, 1, 0, 0, 0, 0, 1]


# ------------------------------------------------------------------ data


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_conversations_validates_and_names_the_line(tmp_path: Path) -> None:
    good = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo", "weight": 0},
                {"role": "user", "content": "and?"},
                {"role": "assistant", "content": "ok"},
            ]
        }
    )
    bad = json.dumps({"messages": [{"role": "robot", "content": "secret-text-123"}]})
    convs = read_conversations(_write(tmp_path, [good, "", good]), "train")
    assert [c.line for c in convs] == [1, 3] and convs[0].weights == [0, 1]
    with pytest.raises(DatasetError) as e:
        read_conversations(_write(tmp_path, [good, bad]), "train")
    assert "train dataset line 2" in str(e.value) and "secret-text-123" not in str(e.value)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not valid JSON"),
        ('{"messages": []}', "missing, empty or not a list"),
        ('{"messages": [{"role": "user", "content": "x", "weight": 1}]}', "only assistant messages take a weight"),
        ('{"messages": [{"role": "assistant", "content": "x", "weight": 2}]}', "0 or 1"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "nothing to learn"),
        ('{"messages": [{"role": "user", "content": 5}]}', "must be a string"),
    ],
)
def test_invalid_lines(tmp_path: Path, line: str, problem: str) -> None:
    with pytest.raises(DatasetError, match=problem):
        read_conversations(_write(tmp_path, [line]), "validation")


def test_holdout_split_is_deterministic_and_disjoint() -> None:
    train, val = holdout_split(20, 0.1, seed=5)
    assert (train, val) == holdout_split(20, 0.1, seed=5)
    assert len(val) == 2 and not set(train) & set(val) and len(train) + len(val) == 20
    with pytest.raises(DatasetError):
        holdout_split(1, 0.1, seed=5)


def test_conversation_is_plain_data() -> None:
    c = Conversation(4, [{"role": "user", "content": "x"}], [])
    assert c.line == 4


# ------------------------------------------------------------------ checkpoints


def test_complete_dir_is_atomic_and_newest_complete_wins(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    ckpt.write_complete_dir(ckpt.step_dir(root, 4), {"a.bin": b"1"})
    ckpt.write_complete_dir(ckpt.step_dir(root, 8), {"a.bin": b"2"})
    (root / "step-12").mkdir()  # a dir without COMPLETE: a writer died
    (root / ".tmp-step-16.999").mkdir()
    assert ckpt.complete_steps(root) == [4, 8]
    assert ckpt.latest_complete(root) == root / "step-8"
    assert (root / "step-8" / "COMPLETE").is_file() and (root / "step-8" / "a.bin").read_bytes() == b"2"
    assert sorted(ckpt.clean_leftovers(root)) == [".tmp-step-16.999", "step-12"]
    with pytest.raises(CheckpointError):
        ckpt.write_complete_dir(ckpt.step_dir(root, 8), {"a.bin": b"3"})


def test_prune_keeps_last_k(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        ckpt.write_complete_dir(ckpt.step_dir(tmp_path, step), {"x": b""})
    assert ckpt.prune(tmp_path, keep=2) == [1, 2]
    assert ckpt.complete_steps(tmp_path) == [3, 4]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_prune_keeps_the_best_step_too_and_says_what_it_freed(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        ckpt.write_complete_dir(ckpt.step_dir(tmp_path, step), {"adapter": b"x" * (100 * step), "state": b"s" * 7})
    sizes = {step: ckpt.dir_bytes(ckpt.step_dir(tmp_path, step)) for step in (1, 2, 3, 4, 5)}
    assert sizes[3] == 300 + 7            # COMPLETE is empty
    assert ckpt.prune_measured(tmp_path, keep=1, also_keep=[2]) == ([1, 3, 4], sizes[1] + sizes[3] + sizes[4])
    assert ckpt.complete_steps(tmp_path) == [2, 5]
    assert ckpt.prune(tmp_path, keep=1, also_keep=[5]) == [2]     # the best is the newest: one stays


def test_write_atomic_replaces(tmp_path: Path) -> None:
    ckpt.write_atomic(tmp_path / "f.json", b"one")
    ckpt.write_atomic(tmp_path / "f.json", b"two", mode=0o644)
    assert (tmp_path / "f.json").read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


# ------------------------------------------------------------------ events, jobenv, exit codes


def test_events_are_one_json_line_each(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", attempt=2, job_id="j")
    log.phase("training")
    log.emit("metrics", step=1, total_steps=3, loss=float("nan"), tokens=10)
    log.close()
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"torn')  # a crashed writer's partial line is skipped by readers
    events = read_events(tmp_path / "events.jsonl")
    assert [e["type"] for e in events] == ["phase", "metrics"]
    assert events[1]["loss"] is None and events[1]["attempt"] == 2 and events[1]["job_id"] == "j"
    with pytest.raises(ValueError):
        EventLog(tmp_path / "e2.jsonl", 0).emit("gossip")


def test_a_phase_is_recorded_once_until_it_changes(tmp_path: Path) -> None:
    """Issue 35: "Phase: training" showed twice (after the first eval, then at the first step)."""
    log = EventLog(tmp_path / "events.jsonl", attempt=0)
    for name in ("tokenizing", "evaluating", "training", "training", "evaluating", "training", "saving"):
        log.phase(name)
    log.close()
    phases = [e["phase"] for e in read_events(tmp_path / "events.jsonl")]
    assert phases == ["tokenizing", "evaluating", "training", "evaluating", "training", "saving"]


def test_attempt_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert attempt_number() == 0
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert attempt_number() == 3


def test_exit_codes_contract() -> None:
    assert (exitcodes.OK, exitcodes.REQUEUE, exitcodes.CANCELLED, exitcodes.PEER_LOST) == (0, 75, 143, 76)
    codes = [
        exitcodes.OK,
        exitcodes.INTERNAL,
        exitcodes.USER_ERROR,
        exitcodes.MODEL_ERROR,
        exitcodes.GPU_UNAVAILABLE,
        exitcodes.PEER_LOST,
        exitcodes.REQUEUE,
        exitcodes.CANCELLED,
    ]
    assert len(set(codes)) == len(codes)


def test_trainer_reads_env_only_in_jobenv_and_never_runs_subprocess() -> None:
    for path in (REPO / "trainer").glob("*.py"):
        source = path.read_text()
        assert not re.search(r"^\s*(import subprocess|from subprocess)", source, re.M), path
        if path.name == "quiet.py":    # sets library defaults for interactive commands, never reads
            assert "getenv" not in source and re.findall(r"os\.environ[.\w]*\(?", source) == \
                ["os.environ.setdefault("] * source.count("os.environ"), path
        elif path.name != "jobenv.py":
            assert "os.environ" not in source and "getenv" not in source, path


# ------------------------------------------------------------------ catalog


def _fake_model(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "model.safetensors").write_bytes(b"\0" * 100)
    (src / "sub" / "tokenizer.json").write_text("{}")
    return src


def test_catalog_add_list_resolve(tmp_path: Path) -> None:
    src = _fake_model(tmp_path)
    root = tmp_path / "models"
    entry = add(src, "fake", root, check=None)
    assert entry.digest == compute_digest(src)
    assert add(src, "fake", root, check=None) == entry  # idempotent
    assert [e.name for e in list_models(root)] == ["fake"]
    path = resolve(root, "fake", entry.digest)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(path / "config.json").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(root / "index.json").st_mode) == 0o644


def test_catalog_detects_silent_change(tmp_path: Path) -> None:
    root = tmp_path / "models"
    entry = add(_fake_model(tmp_path), "fake", root, check=None)
    tok = resolve(root, "fake", entry.digest) / "sub" / "tokenizer.json"
    tok.write_text('{"changed": true}')
    with pytest.raises(ModelDigestError, match="files on disk hash to"):
        resolve(root, "fake", entry.digest)
    with pytest.raises(ModelDigestError, match="not in the catalog"):
        resolve(root, "fake", DIGEST)


def test_catalog_rejects_bad_name(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="invalid model name"):
        add(_fake_model(tmp_path), "../evil", tmp_path / "models", check=None)


def test_disable_dropout_turns_off_every_dropout_and_attention_dropout() -> None:
    """DPO's policy must be scored as its reference was: no LoRA dropout, no base-model dropout."""
    import torch

    from trainer.model import disable_dropout

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_dropout = 0.1
            self.drop = torch.nn.Dropout(0.3)

    model = torch.nn.Sequential(Attention(), torch.nn.Dropout(0.5), torch.nn.Linear(2, 2))
    assert disable_dropout(model) == 3
    assert model[0].attention_dropout == 0.0 and model[0].drop.p == 0.0 and model[1].p == 0.0
    model.train()
    x = torch.ones(4, 2)
    assert torch.equal(model[1](x), x)
