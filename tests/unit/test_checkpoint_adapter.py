"""A checkpoint's adapter as a model: the broker renames its tensors as peft names them (a header
rewrite: the tensor bytes are copied, never parsed) and refuses a header that is not a safetensors one."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from gateway.services.publish import PublishError, check_results
from gateway.storage import layout
from gateway.storage.verbs import _Concat, peft_header


def _rewrite(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        head, offset, length = peft_header(fd)
        out = io.BytesIO()     # as tarfile.addfile reads it: blocks of bufsize, each one full but the last
        tarfile.copyfileobj(_Concat(head, fd, offset, length), out, len(head) + length, bufsize=1000)
        return out.getvalue()
    finally:
        os.close(fd)


def test_the_names_become_peft_names_and_the_tensors_stay_the_same(tmp_path: Path) -> None:
    state = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.randn(4, 8),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.randn(8, 4),
             "base_model.model.model.embed_tokens.lora_embedding_A.default": torch.randn(4, 16, dtype=torch.bfloat16),
             "base_model.model.model.default_head.lora_A.default.weight": torch.randn(2, 3)}
    (tmp_path / "a.safetensors").write_bytes(save(state))
    out = load(_rewrite(tmp_path / "a.safetensors"))
    assert sorted(out) == sorted(["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                                  "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
                                  "base_model.model.model.embed_tokens.lora_embedding_A",
                                  "base_model.model.model.default_head.lora_A.weight"])
    for old, tensor in state.items():
        new = old.replace(".default.", ".").removesuffix(".default")
        assert out[new].dtype == tensor.dtype and torch.equal(out[new], tensor)


def _header(entries: object, data: bytes = b"\0" * 16) -> bytes:
    raw = json.dumps(entries).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize("blob,why", [
    (b"\x01\x00", "shorter"),
    ((1 << 40).to_bytes(8, "little") + b"{}", "header length"),
    (_header([1, 2]), "not an object"),
    (_header({}), "no tensors"),
    (_header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 17]}}), "invalid tensor"),
    (_header({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}), "invalid tensor"),
    (_header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}), "invalid tensor"),
    (_header({"a\n": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}), "invalid tensor"),
    (_header({"a.default.w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
              "a.w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}), "two tensors"),
])
def test_a_hostile_header_is_refused(tmp_path: Path, blob: bytes, why: str) -> None:
    (tmp_path / "x").write_bytes(blob)
    with pytest.raises(ValueError, match=why):
        _rewrite(tmp_path / "x")


def test_a_file_cut_short_while_it_is_copied_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(save({"w.default.weight": torch.randn(64, 64)}))
    fd = os.open(path, os.O_RDWR)
    try:
        head, offset, length = peft_header(fd)
        os.ftruncate(fd, offset + 100)
        with pytest.raises(ValueError, match="changed"):
            io.BufferedReader(_Concat(head, fd, offset, length)).read()
    finally:
        os.close(fd)


def test_results_name_exactly_the_checkpoints_the_broker_says_it_packed() -> None:
    record = [1, "a" * 64]
    main = {n: record for n in layout.RESULT_NAMES}
    assert set(check_results({**main, "checkpoint-step-3.tar": record}, [3])) == set(main) | {"checkpoint-step-3.tar"}
    for results, steps in (({**main, "checkpoint-step-3.tar": record}, []),        # one more than said
                           (main, [3]),                                           # one missing
                           ({**main, "checkpoint-step-0.tar": record}, [0]),      # not a step
                           ({**main, "../x.tar": record}, ["../x"])):
        with pytest.raises(PublishError):
            check_results(results, steps)
    assert layout.checkpoint_step_of("checkpoint-step-12.tar") == 12
    assert layout.checkpoint_step_of("checkpoint-step-012.tar") is None
    with pytest.raises(layout.LayoutError):
        layout.result_path("art-" + "0" * 24, "checkpoint-step-x.tar")
