"""One rank of the FSDP residency probe: ``python fsdp_probe.py MODEL_DIR OUT_DIR`` (writes OUT_DIR/rank<r>.json).

Run as every rank of a world (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, or srun's
SLURM_* names). It builds the model as the recipe does (4-bit, shardable, LoRA, then
``World.shard``), on the CPU over gloo, and writes what this rank holds of the decoder layers'
parameters after sharding, after a training forward, after its backward and after a no-grad
eval, with the whole layers' size and the largest layer's. Rank 1 (and up) zeroes every
weight, buffer and 4-bit quant state of its own load before sharding: its losses then equal rank 0's
unsharded ones only if the shard broadcast rank 0's bits. The measurement lives here, not in the
trainer, so the probe runs unchanged against an older trainer (PYTHONPATH) to show its failure.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def deep_tiny(tiny: Path, out: Path, layers: int) -> Path:
    """The tiny Llama at ``tiny`` (tokenizer and shapes) with ``layers`` decoder layers and a tied
    head, random (seed 0), saved to ``out``: enough layers that 1/N of the decoder plus one layer
    is well under the whole decoder."""
    import shutil

    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny)
    config.num_hidden_layers, config.tie_word_embeddings = layers, True
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    return out


def layer_bytes(model: Any) -> dict[str, int]:
    """The decoder layers' parameters as registered now: a sharded one (DTensor) counts its local
    shard's storage, a whole one (gathered by FSDP, or never sharded) its own; ``whole`` and
    ``largest``: the whole layers' bytes and the largest layer's."""
    from torch.distributed.tensor import DTensor

    from trainer.model import decoder_and_head

    parts = decoder_and_head(model)
    assert parts is not None
    resident = whole = largest = 0
    seen: set[int] = set()
    for layer in parts[0].layers:
        size = 0
        for p in layer.parameters():
            storage = (p.to_local() if isinstance(p, DTensor) else p).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                resident += storage.nbytes()
            size += p.numel() * p.element_size()
        whole, largest = whole + size, max(largest, size)
    return {"resident": resident, "whole": whole, "largest": largest}


def _zero_own_model(model: Any) -> None:
    """Overwrite this rank's weights, buffers and quant states with zeros (what the broadcast must undo)."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                t.data.zero_()
            state = getattr(module, "quant_state", None)
            if state is not None:
                state.absmax.zero_()
                if state.nested:
                    state.state2.absmax.zero_()


def main(model_dir: str, out: str) -> None:
    import torch

    from trainer.contract.spec import Hyperparameters
    from trainer.distributed import World
    from trainer.model import add_lora, eval_sums, load_base_model, row_loss
    from trainer.packing import IGNORE, Row

    t0 = time.monotonic()
    world = World.from_env()
    world.connect("cpu", sharded=True)
    hp = Hyperparameters(lora_r=8, lora_alpha=16, lora_dropout=0.0, max_seq_len=128, gradient_checkpointing=True)
    model = add_lora(load_base_model(model_dir, "cpu", 128, shardable=True), hp)
    torch.manual_seed(1)
    with torch.no_grad():  # non-zero LoRA B: the LoRA weights take part in the losses compared
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = [(7 * i + 3) % 2000 + 5 for i in range(96)]
    row = Row(ids, list(range(48)) + list(range(48)), [IGNORE] * 8 + ids[9:] + [IGNORE])
    with torch.no_grad():
        model.eval()
        whole_loss = float(row_loss(model, row)[0])
        model.train()
    if world.rank > 0:
        _zero_own_model(model)
    world.shard(model)
    figures: dict[str, Any] = {"rank": world.rank, "size": world.size, "whole_loss": whole_loss,
                               "node": os.environ.get("SLURMD_NODENAME"),
                               "after_shard": layer_bytes(model)}
    model.train()
    loss, _, _ = row_loss(model, row)
    figures["after_forward"] = layer_bytes(model)
    loss.backward()
    figures["after_backward"] = layer_bytes(model)
    figures["train_loss"] = float(loss)
    total, *_ = eval_sums(model, [row])
    figures["after_eval"] = layer_bytes(model)
    figures["eval_loss"] = total
    figures["seconds"] = time.monotonic() - t0
    (Path(out) / f"rank{world.rank}.json").write_text(json.dumps(figures), encoding="utf-8")
    world.barrier()
    world.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
