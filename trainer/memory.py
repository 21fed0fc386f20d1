"""What one trainer rank's memory peaks at: an estimate from the model's shape and the job's settings.

Pure (stdlib and the spec; no torch), so the gateway can refuse at create, and report at
estimate, a job that will not fit its partition's GPUs (or, on a CPU partition, its memory
limit). It is an estimate: a sum of the terms below, each what the trainer allocates
(:mod:`trainer.model`, :mod:`trainer.recipe`), checked against measured peaks on the CPU
(tests/trainer/test_memory_estimate_measured.py: the tiny model and SmolLM2, supervised and
DPO, within 25 %). On CUDA the same terms are used with bf16 compute; nothing here has been
measured on a GPU.

Per rank, for one micro-batch row of ``T`` tokens (``max_seq_len``; DPO's rows hold both
sides of a pair, ``2 * max_seq_len``), ``N = min(LOGIT_CHUNK, trained positions)``:

* ``weights``: the decoder's linear layers in 4-bit NF4 with double-quantized absmax
  (:data:`NF4_BYTES` per parameter), the embeddings and an untied head in the compute dtype
  (``trainer.model.add_lora`` casts them back after peft's k-bit upcast: bf16 on CUDA, fp32 on
  the CPU). On the CPU an fp32 checkpoint's embeddings are the mapped file itself (``mapped``:
  file pages, reclaimable, not in the total). FSDP shards the decoder over the ranks, plus one
  layer gathered at a time; the embeddings and head stay whole on every rank.
* ``lora_adam``: the LoRA parameters, fp32, 16 bytes each: weight, gradient, Adam's two moments
  (sharded by FSDP).
* ``activations``: with gradient checkpointing, each layer's input (the residual stream in
  the compute dtype, ``L x T x hidden``) plus, while a layer's backward runs, that layer's
  recomputed activations and the gradients in flight (:data:`GRADIENTS_IN_FLIGHT`); without
  it, every layer's activations. A layer's activations (:func:`layer_tensors`) count its norms, q/k/v and their
  rotary copies, attention output, MLP intermediates and, with LoRA dropout (supervised; DPO
  trains without dropout), the dropout copies of each adapted module's input. On the CPU, what
  the heap keeps of temporaries below the mmap threshold is added (:func:`heap_bytes`).
* ``logits``: ``N x vocab`` fp32 logits, the saved log-softmax and its gradient (3 copies; on
  CUDA also the bf16 head output). The head's backward runs before any layer's, so the peak
  holds the larger of ``logits`` and the layer term, never both.
* ``attention``: the varlen kernels (CUDA) and per-example SDPA (CPU, torch's flash kernel)
  keep O(T) per layer (counted in the layer); only the dense-mask ``sdpa`` fallback adds a
  ``T x T`` boolean mask (``dense_mask``).
* ``transient``: a dequantized weight of the largest linear layer, forward and backward.
* ``runtime``: what the process holds before any model: on the CPU python, torch and the
  Hugging Face stack (:data:`CPU_RUNTIME_BYTES`, measured); on CUDA the context and kernels
  (:data:`CUDA_CONTEXT_BYTES`, a typical figure).

``rows per step`` does not change a rank's peak (a rank runs its rows one after another,
gradients accumulated); ``world_size`` changes it only with FSDP.

On the CPU the figure is anonymous memory (what a memory limit cannot reclaim): file pages
(shared libraries, the mapped checkpoint) are left out. Left out everywhere: loading (the
no-grad DPO reference pass and the evals stay below a training step), fragmentation of the
CUDA caching allocator, and other processes on the GPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from trainer.contract.spec import Hyperparameters
from trainer.heap import MMAP_THRESHOLD as HEAP_MMAP_THRESHOLD
from trainer.model import LOGIT_CHUNK

GIB = 1 << 30
MIB = 1 << 20

NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""4 bits per weight, one 8-bit absmax per 64-weight block, one fp32 absmax per 256 blocks."""

GRADIENTS_IN_FLIGHT = 0.3
"""While a layer's backward runs, the gradients of its activations add about this share of them
(fitted on the CPU measurements: the tiny model and SmolLM2)."""

CPU_RUNTIME_BYTES = 310 * MIB
"""Anonymous memory of a trainer process once torch, transformers, peft and bitsandbytes are imported."""

CUDA_CONTEXT_BYTES = 600 * MIB
"""The CUDA context, cuBLAS workspace and kernels of one process on its GPU (typical; not measured here)."""

STEP_OVERHEAD_BYTES = {"cpu": 8 * MIB, "cuda": 64 * MIB}

_DEFAULTS = Hyperparameters()
"""What a first step allocates besides its tensors (autograd engine, kernels' scratch, allocator slack)."""

Device = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only model's ``config.json`` that its memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    dtype: str = "float32"    # the checkpoint's

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """Read a Hugging Face ``config.json`` object (a multimodal one's ``text_config``).

        Raises:
            ValueError: a field it needs is missing or not a positive integer.
        """
        config = config.get("text_config") or config
        def number(*keys: str, default: int | None = None) -> int:
            for key in keys:
                value = config.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
            if default is None:
                raise ValueError(f"config.json has no positive integer {keys[0]}")
            return default
        hidden = number("hidden_size", "n_embd", "d_model")
        heads = number("num_attention_heads", "n_head")
        return cls(hidden=hidden, layers=number("num_hidden_layers", "n_layer"), heads=heads,
                   kv_heads=number("num_key_value_heads", default=heads),
                   head_dim=number("head_dim", default=hidden // heads),
                   intermediate=number("intermediate_size", "n_inner", default=4 * hidden),
                   vocab=number("vocab_size"), tied=bool(config.get("tie_word_embeddings", True)),
                   dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"))

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output: heads x head_dim (not hidden, e.g. Gemma)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each key/value projection's output: kv_heads x head_dim (GQA)."""
        return self.kv_heads * self.head_dim

    def modules(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear module of one layer (Llama's names, which the
        families we admit share)."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def linear_params(self) -> int:
        """The decoder's linear weights (the 4-bit ones), all layers."""
        return self.layers * sum(a * b for a, b in self.modules().values())

    def embedding_params(self) -> int:
        """The input embeddings and, when not tied to them, the output head."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def parameters(self) -> int:
        """All parameters (norms left out: a few per layer)."""
        return self.linear_params() + self.embedding_params()


def read_shape(model_dir: str | Path) -> ModelShape:
    """The :class:`ModelShape` of the model in ``model_dir`` (its ``config.json``).

    Raises:
        ValueError: the file is missing, not JSON, or lacks a field.
    """
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return ModelShape.from_config(data)


def lora_params(shape: ModelShape, r: int, target_modules: str | list[str]) -> int:
    """LoRA's parameters: ``r x (in + out)`` per adapted module (``all-linear``: every one above)."""
    modules = shape.modules()
    names = list(modules) if target_modules == "all-linear" else [m.rsplit(".", 1)[-1] for m in target_modules]
    return shape.layers * sum(r * sum(modules[n]) for n in names if n in modules)


def layer_tensors(shape: ModelShape, device: Device, dropout: bool) -> list[tuple[int, float, bool]]:
    """The activations one layer keeps for its backward, per token: ``(width, how many, fp32)``.

    The norms compute in fp32, the residual stream and linear outputs are in the compute dtype;
    the CPU path repeats k/v for grouped-query attention; LoRA dropout (supervised) keeps the
    dropped input of each adapted module (and its mask), in fp32: peft casts the input to the
    LoRA weights' dtype."""
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    out: list[tuple[int, float, bool]] = [
        (h, 4, True),                       # two RMSNorms: the fp32 input and its scaled copy
        (h, 3, False),                      # two residual sums and the layer's output
        (q, 1, False), (kv, 2, False),      # q, k, v
        (q, 2, False), (kv, 2, False),      # rotary: rotate_half copies and the rotated q, k
        (q, 1, False),                      # attention output
        (i, 4, False),                      # gate, up, act(gate), act(gate) * up
    ]
    if device == "cpu" and kv != q:
        out.append((q, 2, False))           # k, v repeated to every query head
    if dropout:
        out += [(h, 1.25 * 5, True), (q, 1.25, True), (i, 1.25, True)]
    return out


def layer_elements(shape: ModelShape, device: Device, dropout: bool) -> tuple[float, float]:
    """Per token, the elements of :func:`layer_tensors`: ``(fp32, compute dtype)``."""
    tensors = layer_tensors(shape, device, dropout)
    return (sum(w * n for w, n, fp32 in tensors if fp32), sum(w * n for w, n, fp32 in tensors if not fp32))


def heap_bytes(shape: ModelShape, tokens: int, device: Device, dropout: bool) -> int:
    """CPU: what glibc's heap keeps of the layers' temporaries smaller than :data:`HEAP_MMAP_THRESHOLD`.

    Larger blocks are mapped on their own and unmapped when freed (``trainer.heap``); smaller ones
    come from the heap, where what each layer keeps splits the freed space, so the next layer's
    blocks do not fit in it and the heap grows by them in every layer. Only narrow models on short
    rows have such blocks (the tiny model: a 2026 x 128 fp32 tensor is 1.04 MB); none on CUDA."""
    if device != "cpu":
        return 0
    small = sum(w * n * 4 for w, n, _ in layer_tensors(shape, device, dropout) if tokens * w * 4 < HEAP_MMAP_THRESHOLD)
    return int(shape.layers * tokens * small)


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's peak in bytes, by term (see the module docstring); ``total`` is their sum that peaks at once."""

    weights: int
    lora_adam: int
    activations: int
    logits: int
    attention: int
    transient: int
    runtime: int
    total: int
    mapped: int = 0            # CPU: checkpoint file pages the weights are (not in total)
    device: str = "cuda"
    row_tokens: int = 0

    @property
    def step(self) -> int:
        """The total less the runtime: what the model and its step add to the process."""
        return self.total - self.runtime

    def gib(self) -> float:
        """``total`` in GiB, rounded to 0.01."""
        return round(self.total / GIB, 2)

    def as_dict(self) -> dict[str, Any]:
        """The breakdown in GiB (the API's ``memory`` object)."""
        out: dict[str, Any] = {k: round(v / GIB, 3) for k, v in asdict(self).items() if isinstance(v, int)
                               and k not in ("row_tokens",)}
        out.update(device=self.device, row_tokens=self.row_tokens)
        return out


def estimate(shape: ModelShape, *, max_seq_len: int, method: str = "supervised", world_size: int = 1,
             fsdp: bool = False, gradient_checkpointing: bool = _DEFAULTS.gradient_checkpointing,
             lora_r: int = _DEFAULTS.lora_r, target_modules: str | list[str] = _DEFAULTS.target_modules,
             lora_dropout: float = _DEFAULTS.lora_dropout,
             device: Device = "cuda", row_tokens: int | None = None, trained: int | None = None,
             dense_mask: bool = False) -> MemoryEstimate:
    """One rank's peak memory for a job on ``shape``.

    ``row_tokens``: the longest micro-batch row (default the bound: ``max_seq_len``, DPO
    ``2 * max_seq_len``); ``trained``: its trained positions (default all of them: the
    worst case); ``dense_mask``: the dense-mask ``sdpa`` attention (GPUs older than Ampere).
    """
    dpo = method == "dpo"
    t = row_tokens if row_tokens is not None else (2 if dpo else 1) * max_seq_len
    n = min(LOGIT_CHUNK, t if trained is None else trained)
    compute_bytes = 2 if device == "cuda" else 4
    shards = world_size if fsdp else 1

    linear = shape.linear_params() * NF4_BYTES
    if fsdp and shards > 1:
        linear = linear / shards + linear / shape.layers      # one gathered layer at a time
    embeddings = shape.embedding_params() * compute_bytes
    mapped = 0
    if device == "cpu" and shape.dtype == "float32":          # fp32 compute: the mapped file's tensors
        mapped, embeddings = embeddings, 0
    weights = int(linear + embeddings)
    lora_adam = lora_params(shape, lora_r, target_modules) * 16 // shards

    fp32, compute = layer_elements(shape, device, dropout=lora_dropout > 0 and not dpo)
    layer = t * (fp32 * 4 + compute * compute_bytes)
    inputs: float = shape.layers * t * shape.hidden * compute_bytes
    if gradient_checkpointing:
        kept, backward = inputs, layer * (1 + GRADIENTS_IN_FLIGHT)
    else:
        kept, backward = shape.layers * layer, layer * GRADIENTS_IN_FLIGHT
    logits = n * shape.vocab * (3 * 4 + (2 if device == "cuda" else 0))
    attention = t * t if dense_mask else 0
    heap = heap_bytes(shape, t, device, dropout=lora_dropout > 0 and not dpo)
    transient = 2 * max(a * b for a, b in shape.modules().values()) * compute_bytes
    runtime = CUDA_CONTEXT_BYTES if device == "cuda" else CPU_RUNTIME_BYTES
    total = (weights + lora_adam + kept + max(int(backward), logits) + attention + transient + heap
             + STEP_OVERHEAD_BYTES[device] + runtime)
    return MemoryEstimate(weights=weights, lora_adam=lora_adam, activations=int(kept + backward + heap), logits=logits,
                          attention=attention, transient=transient, runtime=runtime, total=int(total),
                          mapped=mapped, device=device, row_tokens=t)


def estimate_job(shape: ModelShape, hp: Hyperparameters, *, method: str = "supervised", world_size: int = 1,
                 fsdp: bool = False, device: Device = "cuda") -> MemoryEstimate:
    """:func:`estimate` for a job's hyperparameters, at the bound (rows of ``max_seq_len``, every
    position trained): what admission compares with a GPU's memory."""
    return estimate(shape, max_seq_len=hp.max_seq_len, method=method, world_size=world_size, fsdp=fsdp,
                    gradient_checkpointing=hp.gradient_checkpointing, lora_r=hp.lora_r,
                    target_modules=hp.target_modules, lora_dropout=0.0 if method == "dpo" else hp.lora_dropout,
                    device=device)
