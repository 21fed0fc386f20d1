"""Continued training: the LoRA weights of a parent model's published adapter tar.

The gateway pins the tar by the sha256 it recorded at publication; the tar lives in
the tenant's own storage, so it is read as untrusted input: only one regular member
named ``<dir>/adapter_model.safetensors`` (at most :data:`MAX_ADAPTER_BYTES`) is read,
into memory, never extracted; nothing else in the tar is looked at.
"""

from __future__ import annotations

import tarfile
from typing import TYPE_CHECKING, Any

from trainer.contract.errors import DatasetError
from trainer.data import sha256_file

if TYPE_CHECKING:
    import torch

MEMBER = "adapter_model.safetensors"
MAX_ADAPTER_BYTES = 8 << 30
"""The largest adapter read: rank 256 on every linear layer of a 70B model is ~6.5 GB in fp32."""


def read_adapter(path: str, sha256: str) -> dict[str, torch.Tensor]:
    """Return the parent's LoRA tensors by peft's saved names (``...lora_A.weight``).

    Raises:
        DatasetError: the file is unreadable, its sha256 differs from the pin, or it is
            not a tar with exactly one regular ``*/adapter_model.safetensors`` member.
    """
    from safetensors.torch import load as load_safetensors  # lazy: safetensors

    try:
        actual = sha256_file(path)
    except OSError as e:
        raise DatasetError(f"parent adapter {path}: cannot read ({e.strerror})") from e
    if actual != sha256:
        raise DatasetError(f"parent adapter {path}: sha256 is {actual} but the gateway recorded {sha256} "
                           "at publication: the published adapter was changed; train from another model")
    try:
        with tarfile.open(path, mode="r:") as tar:
            found = [m for m in tar.getmembers() if m.name.rsplit("/", 1)[-1] == MEMBER]
            if len(found) != 1 or not found[0].isreg() or found[0].size > MAX_ADAPTER_BYTES:
                raise DatasetError(f"parent adapter {path}: not one regular {MEMBER} of at most "
                                   f"{MAX_ADAPTER_BYTES >> 30} GiB in the tar")
            f = tar.extractfile(found[0])
            data = f.read() if f is not None else b""
    except (OSError, tarfile.TarError) as e:
        raise DatasetError(f"parent adapter {path}: not a readable tar ({type(e).__name__})") from e
    try:
        return dict(load_safetensors(data))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise DatasetError(f"parent adapter {path}: {MEMBER} is not a safetensors file") from e


def match_lora(saved: dict[str, Any], trainable: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Map peft's saved names onto this model's trainable parameters (``lora_A.default.weight``).

    Raises:
        DatasetError: a parameter has no saved tensor, or one of another shape (the parent's
            LoRA shape, r or target modules, differs from this job's).
    """
    out: dict[str, Any] = {}
    for name, shape in trainable.items():
        key = name.replace(".default.", ".")
        value = saved.get(key)
        if value is None or tuple(value.shape) != shape:
            got = "missing" if value is None else f"shape {tuple(value.shape)}"
            raise DatasetError(f"the parent adapter does not fit this job's LoRA: {key} is {got}, this job "
                               f"has {shape} (continued training keeps the parent's lora_r and target modules)")
        out[name] = value
    if len(out) != len(saved):
        raise DatasetError(f"the parent adapter has {len(saved)} tensors, this job's LoRA {len(out)}: "
                           "continued training keeps the parent's target modules")
    return out
