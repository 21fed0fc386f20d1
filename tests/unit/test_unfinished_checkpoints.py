"""A job that ended without publishing (failed, timed out, cancelled) still leaves its complete
checkpoints as adapters (issue 35): the broker's ``checkpoints_build`` packs each one as a succeeded
job's publication does (peft's tensor names, the checkpoint's own ``adapter_config.json``), with no
staging to read; what a tenant's process left half-written or planted is skipped, never followed."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load, save

from gateway.services.jobmodels import CHECKPOINT_MODEL, UNPUBLISHED_HEAD, checkpoint_model_name
from gateway.slurm.render import warning_s
from gateway.storage import layout
from gateway.storage.broker import run_verb
from gateway.storage.verbs import VerbError
from trainer.contract import jobdir

TENANT = "acme"
JOB = "ftjob-" + "cd" * 12
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def _write(root: Path, rel: str, data: bytes) -> None:
    path = root / rel
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(data)


def _checkpoint(root: Path, step: int, *, complete: bool = True, config: bytes | None = None) -> None:
    ck = "/".join(layout.checkpoint(JOB, step))
    _write(root, f"{ck}/{jobdir.CKPT_ADAPTER}", save({"m.q_proj.lora_A.default.weight": torch.full((2, 2), step)}))
    if config is not None:
        _write(root, f"{ck}/{jobdir.ADAPTER_CONFIG}", config)
    if complete:
        _write(root, f"{ck}/{jobdir.COMPLETE}", b"")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = layout.tenant_root(tmp_path, TENANT)
    r.mkdir(mode=0o700, parents=True)
    return r


def _build(root: Path, steps: list[int]) -> dict:  # type: ignore[type-arg]
    storage = root.parents[1]
    return run_verb(storage, TENANT, None, "checkpoints_build", {"job_id": JOB, "checkpoint_steps": steps}, []).result


def _members(root: Path, built: dict, step: int) -> dict[str, bytes]:  # type: ignore[type-arg]
    path = root / layout.ARTIFACTS / built["name"] / layout.checkpoint_result(step)
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}   # type: ignore[union-attr]


def test_complete_checkpoints_are_packed_with_their_config_and_peft_names(root: Path) -> None:
    _checkpoint(root, 10, config=json.dumps(CONFIG).encode())
    _checkpoint(root, 20, config=json.dumps(CONFIG).encode())
    _checkpoint(root, 25, complete=False, config=json.dumps(CONFIG).encode())   # killed while writing
    built = _build(root, [10, 20, 25, 30])
    assert built["checkpoints"] == [10, 20]
    assert built["skipped_checkpoints"] == {"25": "incomplete", "30": "not on disk (pruned)"}
    assert set(built["results"]) == {"checkpoint-step-10.tar", "checkpoint-step-20.tar"}
    files = _members(root, built, 20)
    assert json.loads(files[f"{JOB}-step-20/adapter_config.json"]) == CONFIG
    tensors = load(files[f"{JOB}-step-20/adapter_model.safetensors"])
    assert list(tensors) == ["m.q_proj.lora_A.weight"] and float(tensors["m.q_proj.lora_A.weight"][0, 0]) == 20
    size, sha = built["results"]["checkpoint-step-20.tar"]
    assert size == (root / layout.ARTIFACTS / built["name"] / "checkpoint-step-20.tar").stat().st_size
    assert len(sha) == 64


@pytest.mark.parametrize("config", [None, b"not json", b"[1, 2]", b"[" * 100_000],
                         ids=["absent", "text", "list", "deep"])
def test_a_checkpoint_without_a_usable_config_is_packed_with_its_weights_alone(root: Path,
                                                                               config: bytes | None) -> None:
    _checkpoint(root, 5, config=config)
    built = _build(root, [5])
    assert built["checkpoints"] == [5]
    assert list(_members(root, built, 5)) == [f"{JOB}-step-5/adapter_model.safetensors"]


def test_a_planted_link_in_place_of_the_config_is_never_followed(root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"token": "foreign"}))
    _checkpoint(root, 5)
    os.symlink(secret, root / "/".join(layout.checkpoint(JOB, 5)) / jobdir.ADAPTER_CONFIG)
    built = _build(root, [5])
    assert b"foreign" not in b"".join(_members(root, built, 5).values())


def test_no_complete_checkpoint_is_a_refusal_and_leaves_no_build_dir(root: Path) -> None:
    _checkpoint(root, 5, complete=False)
    with pytest.raises(VerbError) as e:
        _build(root, [5])
    assert e.value.code == "publication_refused" and "step 5: incomplete" in str(e.value)
    assert not any((root / layout.ARTIFACTS).iterdir())


@pytest.mark.parametrize("steps", [[], [0], ["../x"], list(range(1, 200)), "5"])
def test_steps_that_are_not_steps_are_refused(root: Path, steps: object) -> None:
    with pytest.raises(Exception):   # noqa: B017,PT011 - VerbError or LayoutError, both refusals
        _build(root, steps)   # type: ignore[arg-type]


def test_a_job_without_a_model_names_its_checkpoints_by_job_id() -> None:
    failed = SimpleNamespace(fine_tuned_model=None, model="tiny-chat", id=JOB)
    name = checkpoint_model_name(failed, 20)   # type: ignore[arg-type]
    assert name == f"ft:tiny-chat:{JOB}:ckpt-step-20"
    m = CHECKPOINT_MODEL.fullmatch(name)
    assert m and UNPUBLISHED_HEAD.fullmatch(m[1]) and m[2] == "20"
    done = SimpleNamespace(fine_tuned_model=f"ft:tiny-chat:acme:{JOB}", model="tiny-chat", id=JOB)
    assert checkpoint_model_name(done, 20) == f"ft:tiny-chat:acme:{JOB}:ckpt-step-20"   # type: ignore[arg-type]


@pytest.mark.parametrize("grace,minutes,expected", [(90, 60, 90), (90, 1, 15), (90, 2, 30), (90, 6, 90), (5, 1, 5)])
def test_the_time_limit_warning_comes_before_the_end_of_a_short_limit(grace: int, minutes: int, expected: int) -> None:
    assert warning_s(grace, minutes) == expected
    assert 0 < warning_s(grace, minutes) < minutes * 60
