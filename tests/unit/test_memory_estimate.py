"""trainer.memory (the per-rank estimate), the gateway's memory admission and rank widening, and
trainer.packing's rank check: pure functions, no model loaded."""

from __future__ import annotations

import pytest

from trainer import memory
from trainer.contract.spec import Hyperparameters, JobSpec, parse_spec

pytestmark = pytest.mark.unit

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
           "dtype": "float32"}
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False, "dtype": "bfloat16"}
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "intermediate_size": 28672}


def test_shape_and_parameter_count_from_config() -> None:
    shape = memory.ModelShape.from_config(SMOLLM2)
    assert shape.parameters() == pytest.approx(134.5e6, rel=0.01)       # SmolLM2-135M, norms left out
    big = memory.ModelShape.from_config(LLAMA_8B)
    assert big.head_dim == 128 and not big.tied
    assert big.parameters() == pytest.approx(8.03e9, rel=0.01)          # Llama-3-8B
    with pytest.raises(ValueError, match="vocab_size"):
        memory.ModelShape.from_config({k: v for k, v in SMOLLM2.items() if k != "vocab_size"})


def test_lora_params_all_linear_and_named_modules() -> None:
    shape = memory.ModelShape.from_config(SMOLLM2)
    per_layer = 16 * ((576 + 576) + 2 * (576 + 192) + (576 + 576) + 3 * (576 + 1536))
    assert memory.lora_params(shape, 16, "all-linear") == 30 * per_layer
    assert memory.lora_params(shape, 8, ["q_proj", "v_proj"]) == 30 * 8 * ((576 + 576) + (576 + 192))


def test_terms_move_the_way_the_trainer_allocates() -> None:
    shape = memory.ModelShape.from_config(LLAMA_8B)
    base = memory.estimate(shape, max_seq_len=2048)
    kept = shape.layers * 2048 * 4096 * 2                 # each layer's bf16 input, kept for its recompute
    assert base.total == pytest.approx(base.runtime + base.weights + base.lora_adam + base.transient
                                       + memory.STEP_OVERHEAD_BYTES["cuda"] + kept
                                       + max(base.activations - kept, base.logits), abs=8)
    assert 5.0 < base.weights / memory.GIB < 6.5          # 4-bit decoder (3.6 GiB) + bf16 embeddings and head
    longer = memory.estimate(shape, max_seq_len=8192)
    assert longer.activations > 3.5 * base.activations and longer.logits == base.logits   # chunked logits
    dpo = memory.estimate(shape, max_seq_len=2048, method="dpo")
    assert dpo.row_tokens == 4096 and dpo.activations > base.activations   # a row holds both sides
    no_ckpt = memory.estimate(shape, max_seq_len=2048, gradient_checkpointing=False)
    assert no_ckpt.activations > 10 * base.activations
    assert memory.estimate(shape, max_seq_len=2048, world_size=8).total == base.total   # data parallel: whole copy
    sharded = memory.estimate(memory.ModelShape.from_config(LLAMA_70B), max_seq_len=2048, world_size=8, fsdp=True)
    whole = memory.estimate(memory.ModelShape.from_config(LLAMA_70B), max_seq_len=2048)
    assert sharded.weights < whole.weights / 3 and sharded.lora_adam == whole.lora_adam // 8
    assert memory.estimate(shape, max_seq_len=2048, dense_mask=True).attention == 2048 * 2048
    cpu = memory.estimate(memory.ModelShape.from_config(SMOLLM2), max_seq_len=2048, device="cpu")
    assert cpu.mapped == 49152 * 576 * 4 and cpu.runtime == memory.CPU_RUNTIME_BYTES  # fp32 file: mapped


def test_the_gateway_can_import_the_estimate_without_torch() -> None:
    """trainer.memory takes the trainer's own LOGIT_CHUNK and heap threshold (imported, not copied), and
    importing it (as the gateway does) loads neither torch nor transformers."""
    import subprocess
    import sys

    code = ("import sys, trainer.memory as m, trainer.model as t, trainer.heap as h; "
            "assert m.LOGIT_CHUNK == t.LOGIT_CHUNK and m.HEAP_MMAP_THRESHOLD == h.MMAP_THRESHOLD; "
            "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, sorted(heavy)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_heap_term_only_for_blocks_below_the_mmap_threshold() -> None:
    tiny = memory.ModelShape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=344,
                             vocab=1392, tied=False)
    assert memory.heap_bytes(tiny, 2026, "cpu", dropout=True) > 0          # 2026 x 128 fp32: 1.04 MB
    assert memory.heap_bytes(tiny, 2026, "cuda", dropout=True) == 0
    assert memory.heap_bytes(memory.ModelShape.from_config(SMOLLM2), 2025, "cpu", dropout=True) == 0


def test_estimate_job_takes_the_hyperparameters() -> None:
    shape = memory.ModelShape.from_config(LLAMA_8B)
    hp = Hyperparameters(max_seq_len=4096, batch_size_tokens=8192, lora_r=64)
    est = memory.estimate_job(shape, hp)
    assert est == memory.estimate(shape, max_seq_len=4096, lora_r=64)
    assert memory.estimate_job(shape, hp, method="dpo").row_tokens == 8192


# ------------------------------------------------------------------ gateway admission


def _settings(**kw: object):  # type: ignore[no-untyped-def]
    from gateway.config import Settings

    return Settings(**kw)  # type: ignore[arg-type]


def _spec(**hp: object) -> JobSpec:
    return parse_spec({"base_model": {"name": "m", "digest": "sha256:" + "0" * 64},
                       "train": {"path": "/t.jsonl", "sha256": "0" * 64}, "job_dir": "/j", "hyperparameters": hp})


def test_memory_limit_gpu_partition_cpu_partition_and_unknown() -> None:
    from gateway.services.jobmemory import memory_limit

    assert memory_limit(_settings()) == ("default", "cpu", 8192 << 20)       # the dev cluster: CPU, --mem
    assert memory_limit(_settings(slurm_partition="a100", gpu_memory_gib={"a100": 80})) == \
        ("a100", "cuda", 80 << 30)
    assert memory_limit(_settings(slurm_partition="a100", gpu_memory_gib={"default": 24}))[1] == "cpu"
    assert memory_limit(_settings(job_device="cuda")) == ("default", "cuda", None)  # not known: not checked
    assert memory_limit(_settings(job_device="cpu", gpu_memory_gib={"default": 80}))[1] == "cpu"


def test_memory_check_refuses_with_the_figures_and_admits_what_fits() -> None:
    from gateway.services.jobmemory import memory_check

    shape = memory.ModelShape.from_config(LLAMA_8B)
    small_gpu = _settings(gpu_memory_gib={"default": 16})
    fits = memory_check(small_gpu, _spec(), shape)
    assert fits.fits is True and fits.as_dict()["per_gpu_gib"] == memory.estimate(shape, max_seq_len=2048).gib()
    big = memory_check(small_gpu, _spec(max_seq_len=16384, batch_size_tokens=16384), shape)
    assert big.fits is False
    text = big.refusal()
    assert f"needs ~{big.estimate.total / memory.GIB:.1f} GiB per GPU" in text
    assert "partition default's GPUs have 16.0 GiB" in text
    cpu = memory_check(_settings(job_mem_mb=4096), _spec(), shape)
    assert cpu.estimate.device == "cpu" and cpu.fits is False and "memory limit is 4.0 GiB" in cpu.refusal()
    assert memory_check(_settings(job_device="cuda"), _spec(), shape).fits is None
    assert memory_check(_settings(gpu_memory_gib={"default": 80}), _spec(), shape).as_dict()["fits"] is True


# ------------------------------------------------------------------ idle ranks


def test_widen_default_budget_refuse_explicit_one() -> None:
    from gateway.errors import ServiceError
    from gateway.services.jobmemory import widen_for_ranks

    hp: dict[str, object] = {}
    note = widen_for_ranks(hp, "supervised", 8)
    assert hp["batch_size_tokens"] == 8 * 2048 and note is not None and "4096 to 16384" in note
    dpo: dict[str, object] = {"max_seq_len": 512}
    widen_for_ranks(dpo, "dpo", 8)                                        # a row holds a pair's both sides
    assert dpo["batch_size_tokens"] == 8 * 2 * 512
    assert widen_for_ranks({}, "supervised", 2) is None                  # 4096 / 2048: a row per rank
    same: dict[str, object] = {"max_seq_len": 512}
    assert widen_for_ranks(same, "supervised", 8) is None and "batch_size_tokens" not in same
    with pytest.raises(ServiceError, match="at least 16384") as e:
        widen_for_ranks({"batch_size_tokens": 4096}, "supervised", 8)
    assert e.value.code == "idle_ranks" and "6 rank(s) would idle" in e.value.message
    assert widen_for_ranks({"batch_size_tokens": 768, "max_seq_len": 256}, "dpo", 2) is None   # 2 rows of 512
    assert widen_for_ranks({"max_seq_len": "x"}, "supervised", 8) is None   # the spec check names it later


def test_rows_per_step_and_the_idle_rank_warning() -> None:
    from trainer.packing import idle_ranks, micro_batches, pack, plan, rows_per_step

    lengths = [300, 500, 200, 900, 100, 700, 400, 600]
    steps = plan(lengths, 1200, seed=0, epochs=1)[0]
    rows = rows_per_step(steps, lengths, 512 + 512)
    assert rows == [len(pack([lengths[i] for i in s], list(range(len(s))), 1024)) for s in steps]
    from trainer.packing import Example

    examples = [Example(tuple(range(n)), (0,) * n, i) for i, n in enumerate(lengths)]
    assert rows == [len(micro_batches([examples[i] for i in s], 1024)) for s in steps]
    assert idle_ranks(rows, 1) is None and idle_ranks(rows, min(rows)) is None
    warning = idle_ranks(rows, 8)
    assert warning is not None and f"{len(rows)} of {len(rows)} steps" in warning and "8 ranks" in warning
    # the plan does not depend on the world size: a checkpoint resumes on any number of ranks
    assert plan(lengths, 1200, seed=0, epochs=2) == plan(lengths, 1200, seed=0, epochs=2)
