"""JSON a tenant's process wrote (checkpoint headers, the manifest, eval.json, metrics lines) is
bounded in depth before it is parsed: 200k nested ``[`` skip that one checkpoint (or refuse that
attempt), never fail the publication with a RecursionError."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from gateway.storage import layout
from gateway.storage.broker import run_verb
from gateway.storage.verbs import MAX_JSON_DEPTH, VerbError, json_depth, metrics_csv, tenant_json

TENANT = "acme"
JOB = "ftjob-" + "ab" * 12
DEEP = b"[" * 200_000


@pytest.mark.parametrize("raw,depth", [
    (b"1", 0), (b"[]", 1), (b'{"a": [1, {"b": []}]}', 4),
    (b'["[[[", "\\"[{", "\\\\", [["]]]"]]]', 3),             # brackets and escapes inside strings
    ('{"ä[": ["€{"]}'.encode(), 2),
])
def test_json_depth_counts_structure_only(raw: bytes, depth: int) -> None:
    assert json_depth(raw) == depth
    assert tenant_json(raw) == json.loads(raw)


@pytest.mark.parametrize("raw", [DEEP, b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
                                 '["\\u0000"]'.encode("utf-16"), b"\xff["])
def test_too_deep_or_not_utf8_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        tenant_json(raw)


def test_a_deep_metrics_line_is_skipped() -> None:
    out = metrics_csv(DEEP + b"\n" + b'{"step": 1, "loss": 2.5}\n').decode().splitlines()
    assert out == ["step,loss,lr,tokens_per_s,elapsed_s,tokens", "1,2.5,,,,"]


def _write(root: Path, rel: str, data: bytes) -> None:
    path = root / rel
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(data)


def _staging(root: Path, eval_json: bytes = b'{"before": {"loss": 2.0}, "after": {"loss": 1.0}}',
             manifest_extra: bytes = b"") -> None:
    files = {"adapter_model.safetensors": save({"x.lora_A.weight": torch.ones(2, 2)}),
             "adapter_config.json": b'{"peft_type": "LORA"}', "eval.json": eval_json}
    manifest = json.dumps({"attempt": 0, "files": {n: f"sha256:{hashlib.sha256(b).hexdigest()}"
                                                   for n, b in files.items()}}).encode()
    if manifest_extra:
        manifest = manifest[:-1] + b', "x": ' + manifest_extra + b"}"
    staging = "/".join(layout.staging(JOB, 0))
    for name, data in {**files, "manifest.json": manifest}.items():
        _write(root, f"{staging}/{name}", data)
    _write(root, f"{staging}/COMPLETE", f"manifest sha256:{hashlib.sha256(manifest).hexdigest()}\n".encode())


def _checkpoint(root: Path, step: int, adapter: bytes) -> None:
    ck = "/".join(layout.checkpoint(JOB, step))
    _write(root, f"{ck}/COMPLETE", b"")
    _write(root, f"{ck}/adapter.safetensors", adapter)


def _publish(storage: Path) -> dict[str, Any]:
    return run_verb(storage, TENANT, None, "publish_build",
                    {"job_id": JOB, "attempt": 0, "checkpoint_steps": [3, 6]}, []).result


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    return tmp_path


def test_a_nested_bracket_checkpoint_header_skips_that_checkpoint_only(storage: Path) -> None:
    root = layout.tenant_root(storage, TENANT)
    root.mkdir(mode=0o700, parents=True)
    _staging(root)
    _checkpoint(root, 3, save({"x.lora_A.default.weight": torch.ones(2, 2)}))
    _checkpoint(root, 6, len(DEEP).to_bytes(8, "little") + DEEP + b"\0" * 16)
    result = _publish(storage)
    assert result["checkpoints"] == [3]
    assert "nests deeper" in result["skipped_checkpoints"]["6"]
    assert set(result["results"]) == {*layout.RESULT_NAMES, "checkpoint-step-3.tar"}


@pytest.mark.parametrize("where", ["eval", "manifest"])
def test_a_nested_eval_or_manifest_refuses_the_attempt_clearly(storage: Path, where: str) -> None:
    root = layout.tenant_root(storage, TENANT)
    root.mkdir(mode=0o700, parents=True)
    _staging(root, **({"eval_json": DEEP} if where == "eval" else {"manifest_extra": DEEP}))
    with pytest.raises(VerbError) as e:
        _publish(storage)
    assert e.value.code == "publication_refused"
