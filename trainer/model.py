"""Model pieces of the recipe: device, 4-bit loading, LoRA, the packed-row loss, eval.

Torch and the Hugging Face stack are imported inside the functions so that
``trainer`` modules stay importable (and fail fast) without them.

Attention over a packed row (examples concatenated, ``position_ids``
restarting at 0 per example, ``attention_mask=None``, no cache), by
implementation (:func:`attention_implementation`):

* ``flash_attention_2`` (CUDA, compute capability >= 8.0, when the
  ``flash_attn`` package imports): transformers' ``flash_attention_mask``
  returns ``None`` and the kernel is ``flash_attn_varlen_func`` over the
  example boundaries (``cu_seq_lens_*``, passed from the row by
  :func:`row_loss`, so transformers does not re-derive them from
  ``position_ids`` in every layer): no mask at all, attention memory O(T).
* ``sft_varlen`` (:mod:`trainer.attention`; CUDA >= 8.0 without flash_attn,
  and the CPU): the same boundaries, no mask either (transformers builds none
  for an implementation it has no mask function for). On CUDA it is torch's
  own flash varlen kernel (``torch.nn.attention.varlen``); on the CPU one
  causal SDPA per example (scores sum(L_i^2), not T^2).
* ``sdpa`` (older GPUs, and architectures that refuse a custom attention
  function): ``sdpa_mask`` builds one dense boolean ``(1, 1, T, T)``
  block-diagonal causal mask per forward. ``T <= max_seq_len`` because rows
  never exceed it, so the mask costs at most ``max_seq_len**2`` bytes (a
  warning past :data:`DENSE_MASK_LIMIT`).
* ``flex_attention`` is not used: its kernel needs ``torch.compile`` (Triton),
  and under autocast q/k reach it in fp32 (RoPE on the fp32 embeddings) with
  v in bf16; nothing casts those for flex.

Whatever the path, ``models add`` checks that a packed row's loss equals the
examples' unpacked losses (``trainer.packcheck``) with the model loaded as
here.

On CUDA every forward runs under ``torch.autocast(bfloat16)``; the LoRA
weights (and what ``prepare_model_for_kbit_training`` upcasts) stay fp32
masters, the 4-bit layers compute in bf16. Logits exist only at trained
positions, ``LOGIT_CHUNK`` at a time (:func:`row_loss`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import attention
from trainer.attention import VARLEN
from trainer.contract.errors import GpuUnavailableError
from trainer.contract.spec import HYPERPARAMETER_DEFAULTS, Hyperparameters
from trainer.heap import map_large_blocks
from trainer.jobenv import gpu_environment, real_gpu_allocated
from trainer.packing import IGNORE, Example, Row, micro_batches, sequence_bounds

if TYPE_CHECKING:
    import torch

log = logging.getLogger("trainer")

LOGIT_CHUNK = 1024
"""Trained positions whose logits exist at once: peak logits memory is LOGIT_CHUNK x vocab."""

DENSE_MASK_LIMIT = 16_384
"""Past this ``max_seq_len``, sdpa's dense T x T mask (T**2 bytes: 256 MiB here) draws a warning on CUDA."""

# CausalLM forwards that are exactly ``lm_head(decoder(...).last_hidden_state)``
# (read in transformers 5.24); others (logit soft-capping, scaling, biases) keep
# the model's own forward with ``logits_to_keep``.
_PLAIN_HEAD = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "gemma", "olmo2"})


# ----------------------------------------------------------------- device


def pick_device(requested: str, cuda_available: bool, environment: str, gpu_promised: bool = False) -> str:
    """Return ``"cuda"`` or ``"cpu"`` for the spec's ``device`` (``auto``/``cuda``/``cpu``).

    ``gpu_promised``: Slurm allocated a GPU on a node with the NVIDIA driver
    (``jobenv.real_gpu_allocated``); then ``auto`` refuses the CPU too.

    Raises:
        GpuUnavailableError: ``requested`` is ``"cuda"``, or ``"auto"`` with a
            GPU promised, and CUDA is not available.
    """
    if requested == "cpu":
        return "cpu"
    if not cuda_available and (requested == "cuda" or gpu_promised):
        raise GpuUnavailableError(
            "this job was given a GPU but CUDA is not usable here (torch.cuda.is_available() is False; "
            f"{environment}): refusing to train on the CPU; submit the job again, and tell the operators "
            "if it keeps failing on this node"
        )
    return "cuda" if cuda_available else "cpu"


def resolve_device(requested: str) -> str:
    """Return the device to train on; with ``"cuda"``, also check that one allocation works.

    Raises:
        GpuUnavailableError: ``requested`` is ``"cuda"`` and CUDA is unavailable or fails.
    """
    import torch  # lazy: torch


    device = pick_device(requested, torch.cuda.is_available(), gpu_environment(), real_gpu_allocated())
    if device == "cuda":
        try:
            torch.zeros(1, device="cuda")
        except RuntimeError as e:  # a driver/device error: no dataset text in it
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GpuUnavailableError(
                f"this job was given a GPU but CUDA fails here ({first}; {gpu_environment()}): "
                "refusing to train on the CPU; submit the job again"
            ) from e
    return device


def attention_implementation(device: str, max_seq_len: int) -> str:
    """Return the ``attn_implementation`` to load with (see the module docstring for each), and log
    why ("attention X: reason", at job start). Every one honours sliding windows; soft-capping
    and sinks are honoured by ``sft_varlen`` per example (``trainer.attention``), and the
    architectures ``models add`` admits are checked against eager on each (``trainer.packcheck``)."""
    if device != "cuda":
        log.info("attention %s: on the CPU, one SDPA per packed example", attention.VARLEN)
        return attention.register()
    import torch  # lazy: torch
    from transformers.utils import is_flash_attn_2_available  # lazy: transformers

    if is_flash_attn_2_available() and torch.cuda.get_device_capability()[0] >= 8:  # FA2 needs Ampere+
        try:
            import flash_attn  # noqa: F401 - a wheel built for another torch/CUDA fails here
        except (ImportError, OSError) as e:
            log.warning("flash_attn is installed but does not import (%s)", type(e).__name__)
        else:
            log.info("attention flash_attention_2: flash_attn imports and the GPU is Ampere or newer")
            return "flash_attention_2"
    if attention.cuda_varlen_available():
        log.info("attention %s: no usable flash_attn; torch's varlen kernel over the packed examples",
                 attention.VARLEN)
        return attention.register()
    log.info("attention sdpa: no varlen kernel on this GPU (needs Ampere or newer); a dense block-diagonal mask")
    if max_seq_len > DENSE_MASK_LIMIT:
        log.warning("no varlen attention on this GPU: sdpa builds a dense %d x %d mask per row (%d MiB)",
                    max_seq_len, max_seq_len, max_seq_len**2 >> 20)
    return "sdpa"


# ----------------------------------------------------------------- loading


def compute_dtype(device: str) -> torch.dtype:
    """The dtype the model computes in on ``device``: bfloat16 on CUDA (autocast), float32 on the CPU.

    4-bit matmuls dequantize to it, and :func:`add_lora` keeps the frozen embeddings and
    LM head in it.
    """
    import torch  # lazy: torch

    return torch.bfloat16 if device == "cuda" else torch.float32


def staging_device(device: str, shardable: bool) -> str:
    """Where :func:`load_base_model` puts the weights: the CPU for a shardable (FSDP) model on CUDA,
    which :meth:`trainer.distributed.World.shard` then moves to the rank's GPU one layer at a time,
    so no rank ever holds the whole model on its GPU; else ``device``."""
    return "cpu" if shardable else device


def load_base_model(path: str | Path, device: str | None = None,
                    max_seq_len: int = HYPERPARAMETER_DEFAULTS["max_seq_len"],
                    shardable: bool = False) -> Any:
    """Load a base model in 4-bit NF4 (double quant) for ``device`` (default: CUDA when present).

    Chooses the attention implementation (:func:`attention_implementation`) and
    applies the bitsandbytes AVX512-BF16 workaround (see ``disable_cpu_repack``).
    ``shardable`` (FSDP): the packed 4-bit weights are stored as bfloat16 elements
    (``bnb_4bit_quant_storage``), the same bits, so FSDP can shard them like any parameter,
    and the model is loaded (and quantized) on the CPU even for CUDA (:func:`staging_device`),
    in CUDA's compute dtype and attention; ``World.shard`` moves it layer by layer, each rank
    keeping only its shards (every rank reads the files, as transformers' FSDP loading does
    for a model it quantizes; rank 0's bits are then broadcast).
    """
    import torch  # lazy: torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # lazy: transformers

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = staging_device(device, shardable) == "cuda"
    compute = compute_dtype(device)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
        **({"bnb_4bit_quant_storage": torch.bfloat16} if shardable else {}),
    )
    attention = attention_implementation(device, max_seq_len)
    # the current device: cuda:<local rank> on a data-parallel rank (trainer.distributed), else 0
    load = {"quantization_config": quant, "dtype": compute,
            "device_map": {"": torch.cuda.current_device()} if cuda else "cpu"}
    # an architecture that takes no custom attention function falls back to sdpa, and one that
    # refuses sdpa too (Gemma2: its soft-capping) to eager, the reference every path is checked against
    choices = list(dict.fromkeys([attention, "sdpa", "eager"]))
    for i, choice in enumerate(choices):
        try:
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=choice, **load)
            break
        except ValueError as e:
            if i + 1 == len(choices):
                raise
            log.info("attention %s refused (%s); loading with %s", choice, str(e).splitlines()[0][:200],
                     choices[i + 1])
    log.info("base model on %s%s, attention %s", device, " (staged on the cpu)" if device == "cuda" and not cuda
             else "", model.config._attn_implementation)
    disable_cpu_repack(model)
    return model


def disable_cpu_repack(model: Any) -> int:
    """Stop bnb from repacking 4-bit weights for inference on AVX512-BF16 CPUs.

    bnb 0.49-0.50 repacks a ``Linear4bit`` the first time it runs in eval mode
    without grad and never undoes it; LoRA gradients are silently wrong after
    any eval pass. Returns the number of layers patched.
    """
    import bitsandbytes as bnb  # lazy: bitsandbytes

    patched = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            patched += 1
    return patched


def add_lora(model: Any, hp: Hyperparameters, dropout: bool = True) -> Any:
    """Prepare a k-bit model for training and wrap it with LoRA (seeded init).

    ``dropout=False`` (DPO, as TRL's ``disable_dropout``): the policy trains without any
    dropout, LoRA's and the base model's alike, so it is scored as the reference was (in
    eval mode, without dropout); ``hp.lora_dropout`` is then not used.

    peft's k-bit preparation upcasts every non-4-bit weight to float32; the frozen embeddings
    and LM head are then put back in the model's compute dtype (bfloat16 on CUDA,
    :func:`cast_frozen_embeddings`): autocast caches no cast of a frozen weight, so a float32
    head was cast again for every logit chunk and every recompute. LoRA weights stay float32.
    """
    import torch  # lazy: torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training  # lazy: peft

    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=hp.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    compute = _loaded_compute_dtype(model)
    if compute is not None and compute != torch.float32:
        cast_frozen_embeddings(model, compute)
    torch.manual_seed(hp.seed)
    config = LoraConfig(
        r=hp.lora_r,
        lora_alpha=hp.lora_alpha,
        lora_dropout=hp.lora_dropout if dropout else 0.0,
        target_modules=hp.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    if not dropout:
        disable_dropout(model)
    return model


def adapter_config_json(model: Any) -> bytes:
    """``model``'s LoRA config as peft's ``save_pretrained`` writes ``adapter_config.json`` (sets as
    lists, keys sorted), from the peft model itself or the one a parallel wrapper holds (``.module``):
    what a checkpoint carries so that a job that never finished still leaves adapters peft loads."""
    inner = model if hasattr(model, "peft_config") else getattr(model, "module", model)
    config = inner.peft_config["default"].to_dict()
    return json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in config.items()},
                      indent=2, sort_keys=True, default=str).encode()


def _loaded_compute_dtype(model: Any) -> torch.dtype | None:
    """The compute dtype :func:`load_base_model` gave the 4-bit layers (None: no 4-bit layer)."""
    import bitsandbytes as bnb  # lazy: bitsandbytes

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            return module.compute_dtype  # type: ignore[no-any-return]
    return None


def cast_frozen_embeddings(model: Any, dtype: torch.dtype) -> list[str]:
    """Cast the frozen input embeddings and LM head of ``model`` to ``dtype`` in place (a tied
    weight once, and still tied); trainable ones (and the norms) keep their dtype. Returns the
    names of the weights cast."""
    cast = []
    named = {id(p): n for n, p in model.named_parameters()}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = getattr(module, "weight", None)
        if weight is None or weight.requires_grad or weight.dtype == dtype:
            continue
        weight.data = weight.data.to(dtype)
        cast.append(named.get(id(weight), "?"))
    return cast


def disable_dropout(model: Any) -> int:
    """Set every ``torch.nn.Dropout`` of ``model`` to p = 0 (TRL's ``disable_dropout_in_model``), and
    the attention dropout transformers' attention modules read from ``attention_dropout``; return how
    many modules were changed."""
    import torch  # lazy: torch

    found = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
            found += 1
        elif isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
            found += 1
    return found


def compile_layers(model: Any) -> int:
    """``torch.compile`` each decoder layer (regional: small graphs, masks stay eager); CUDA only.

    ``dynamic=True`` because every row has its own length. Returns the number
    of layers compiled (0 when the decoder has no ``layers`` list).
    """
    parts = decoder_and_head(model)
    layers = getattr(parts[0], "layers", None) if parts else None
    if layers is None:
        return 0
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


# ----------------------------------------------------------------- loss


def decoder_and_head(model: Any) -> tuple[Any, Any] | None:
    """Return ``(decoder, lm_head)`` of a (peft-wrapped) causal LM, or None when its
    logits are not exactly ``lm_head(decoder hidden states)``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "model_type", None) not in _PLAIN_HEAD:
        return None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    head = base.get_output_embeddings()
    if decoder is None or decoder is base or head is None:
        return None
    return decoder, head


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    import torch  # lazy: torch

    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _flash_kwargs(model: Any, row: Row, device: torch.device) -> dict[str, Any]:
    """Example boundaries for the varlen kernels (flash-attention, ``sft_varlen`` and its CPU emulation);
    empty for others. ``max_length_*`` is a python int, so the kernels never read it back from the device."""
    import torch  # lazy: torch


    implementation = str(getattr(model.config, "_attn_implementation", ""))
    if not (implementation.startswith("flash_attention") or implementation.startswith(VARLEN)):
        return {}
    bounds = sequence_bounds(row.position_ids)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _head_loss(
    head: Any, hidden: torch.Tensor, targets: torch.Tensor, count_correct: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and correct-argmax count of one chunk of trained positions.

    ``count_correct=False`` (training) skips the argmax over the vocabulary and counts 0.
    """
    import torch  # lazy: torch
    import torch.nn.functional as F  # lazy: torch

    logits = head(hidden).float()
    loss = F.cross_entropy(logits, targets, reduction="sum")
    if not count_correct:
        return loss, torch.zeros((), dtype=torch.long, device=logits.device)
    return loss, (logits.detach().argmax(-1) == targets).sum()


def _trained_states(model: Any, row: Row) -> tuple[Any, torch.Tensor, torch.Tensor, list[int]]:
    """Forward one packed row (under autocast); return ``(head, states, targets, keep)``.

    ``keep``: the row's trained positions, ``targets`` their next tokens. For a
    ``_PLAIN_HEAD`` model ``states`` are the decoder's hidden states at those
    positions (``head`` turns them into logits, chunk by chunk); for others
    ``head`` is None and ``states`` are already the fp32 logits there (the
    model's own forward with ``logits_to_keep``). With no trained position the
    states are the whole row's hidden states (for the zero-weight backward).
    On the CPU the first forward fixes glibc's mmap threshold (:mod:`trainer.heap`): else the
    heap keeps every layer's freed activations, and a 4029-token DPO row took SmolLM2 past 8 GB.
    """
    import torch  # lazy: torch


    device = next(p.device for p in model.parameters())
    if device.type == "cpu":
        map_large_blocks()
    keep = [i for i, t in enumerate(row.targets) if t != IGNORE]
    ids = torch.tensor([row.input_ids], device=device)
    positions = torch.tensor([row.position_ids], device=device)
    keep_t = torch.tensor(keep, device=device)
    targets = torch.tensor([row.targets[i] for i in keep], device=device)
    flash = _flash_kwargs(model, row, device)
    parts = decoder_and_head(model)
    if parts is None:
        out = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep_t, **flash)
        return None, out.logits[0].float(), targets, keep
    decoder, head = parts
    hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False, **flash).last_hidden_state[0]
    return head, (hidden.index_select(0, keep_t) if keep else hidden), targets, keep


def row_loss(model: Any, row: Row, chunk: int = LOGIT_CHUNK) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Forward one packed row; return (summed loss, trained tokens, correct argmax count).

    No attention mask and no cache: per-example ``position_ids`` keep packed
    examples apart (see the module docstring). The decoder's hidden states are
    taken at trained positions only; ``lm_head`` + cross-entropy then run
    ``chunk`` positions at a time. With gradients on and more than one chunk,
    each chunk runs under activation checkpointing (its logits are recomputed
    in backward, never kept), so at most ``chunk x vocab`` logits exist; a
    single chunk is not recomputed (keeping it costs the same peak as
    recomputing it). With gradients on, the correct-argmax count is 0 (it
    serves evals only). Models outside ``_PLAIN_HEAD`` use their own forward
    with ``logits_to_keep`` (all trained positions' logits).
    """
    import torch  # lazy: torch
    import torch.nn.functional as F  # lazy: torch
    from torch.utils.checkpoint import checkpoint  # lazy: torch

    device = next(p.device for p in model.parameters())
    with _autocast(device):
        head, kept, targets, keep = _trained_states(model, row)
        if head is None:
            logits = kept
            return F.cross_entropy(logits, targets, reduction="sum"), len(keep), (logits.argmax(-1) == targets).sum()
        if not keep:  # connected to the graph, so a sharded rank's zero-weight backward still runs its hooks
            return kept.float().sum() * 0.0, 0, torch.zeros((), dtype=torch.long, device=device)
        loss = kept.new_zeros((), dtype=torch.float32)
        correct = torch.zeros((), dtype=torch.long, device=device)
        training = torch.is_grad_enabled()
        recompute = training and len(keep) > chunk
        for start in range(0, len(keep), chunk):
            piece = (head, kept[start : start + chunk], targets[start : start + chunk], not training)
            if recompute:
                part, ok = checkpoint(_head_loss, *piece, use_reentrant=False)
            else:
                part, ok = _head_loss(*piece)
            loss, correct = loss + part, correct + ok
    return loss, len(keep), correct


def _head_logps(head: Any, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The fp32 log-probability of each target of one chunk of trained positions."""
    import torch.nn.functional as F  # lazy: torch

    return -F.cross_entropy(head(hidden).float(), targets, reduction="none")


def row_logps(model: Any, row: Row, chunk: int = LOGIT_CHUNK) -> torch.Tensor:
    """Forward one packed row; return each of its examples' summed log-probability of its trained
    tokens (fp32, one per example in row order; with gradients when they are on).

    The same forward as :func:`row_loss` (trained positions only, ``chunk`` logits at a time,
    recomputed in backward past one chunk); the per-token log-probs are then summed per example
    (an example starts where ``position_ids`` restart at 0).
    """
    import torch  # lazy: torch
    from torch.utils.checkpoint import checkpoint  # lazy: torch

    device = next(p.device for p in model.parameters())
    starts = torch.tensor([p == 0 for p in row.position_ids], device=device)
    owner = torch.cumsum(starts.long(), 0) - 1        # the example each position belongs to
    n = int(starts.sum())
    with _autocast(device):
        head, kept, targets, keep = _trained_states(model, row)
        if not keep:
            return kept.float().sum() * 0.0 + torch.zeros(n, device=device)
        if head is None:
            token_logps = -torch.nn.functional.cross_entropy(kept, targets, reduction="none")
        else:
            recompute = torch.is_grad_enabled() and len(keep) > chunk
            pieces = []
            for start in range(0, len(keep), chunk):
                piece = (head, kept[start : start + chunk], targets[start : start + chunk])
                pieces.append(checkpoint(_head_logps, *piece, use_reentrant=False) if recompute
                              else _head_logps(*piece))
            token_logps = torch.cat(pieces)
    owners = owner.index_select(0, torch.tensor(keep, device=device))
    return torch.zeros(n, device=device, dtype=torch.float32).index_add(0, owners, token_logps)


def accumulate_gradients(
    model: Any, rows: list[Row], total: int | None = None, pad: Row | None = None, pad_passes: int = 0
) -> tuple[float, int]:
    """Forward and backward each row (micro-batch) of one optimizer step.

    Each row's summed loss is divided by ``total``, the trained tokens of the
    whole step (default: those of ``rows``), so the accumulated gradients are
    those of the step's token-mean loss (one large batch). Data parallel: each
    rank passes its own rows and the step's ``total`` over all ranks, and the
    sum over ranks of the gradients (and of the returned losses) is the step's.
    Sharded (FSDP): every rank must run as many backward passes, so with ``pad``
    every row runs backward (a row without trained tokens weighted 0) and then
    ``pad_passes`` passes of ``pad`` weighted 0 follow.
    Returns (these rows' summed loss / ``total``, ``total``).
    """
    import torch  # lazy: torch

    if total is None:
        total = sum(row.n_targets for row in rows)
    losses = []
    passes = [*rows, *([pad] * pad_passes if pad is not None else [])]
    for i, row in enumerate(passes):
        loss, trained, _ = row_loss(model, row)
        if trained and i < len(rows):
            (loss / total).backward()
            losses.append(loss.detach())
        elif pad is not None:
            (loss * 0.0).backward()
    return float(torch.stack(losses).sum()) / max(total, 1) if losses else 0.0, total


def eval_sums(
    model: Any, rows: list[Row], check: Callable[[], None] | None = None, pad: Row | None = None,
    pad_passes: int = 0,
) -> tuple[float, int, int, float, float, int]:
    """Return (summed loss, trained tokens, correct argmaxes, sum and sum of squares of the rows'
    mean losses, rows) over packed ``rows``, without gradients (the last three: the eval's spread).

    ``check`` runs before each row (a signal may interrupt a long eval). Data
    parallel: each rank sums its share of the rows and the sums are added up.
    Sharded (FSDP): ``pad_passes`` forwards of ``pad`` follow, counted nowhere,
    so every rank runs as many forwards.
    """
    import torch  # lazy: torch

    total, tokens, correct = 0.0, 0, 0
    s1, s2, counted = 0.0, 0.0, 0
    model.eval()
    try:
        with torch.no_grad():
            passes = [*rows, *([pad] * pad_passes if pad is not None else [])]
            for i, row in enumerate(passes):
                if check is not None:
                    check()
                loss, n, ok = row_loss(model, row)
                if i >= len(rows):  # padding
                    continue
                total, tokens, correct = total + float(loss), tokens + n, correct + int(ok)
                if n:
                    mean = float(loss) / n
                    s1, s2, counted = s1 + mean, s2 + mean * mean, counted + 1
    finally:
        model.train()
    return total, tokens, correct, s1, s2, counted


def eval_metrics(total: float, tokens: int, correct: int, examples: int,
                 spread: tuple[float, float, int] | None = None) -> dict[str, float | None]:
    """Return the eval record (token-weighted loss, perplexity, token accuracy, counts) of :func:`eval_sums`;
    with ``spread`` (its rows' mean-loss sum, sum of squares and count), ``loss_stderr``: the standard
    error of the rows' mean losses (None under two rows)."""
    mean = total / max(tokens, 1)
    out: dict[str, float | None] = {
        "loss": mean,
        "perplexity": math.exp(min(mean, 50.0)),
        "token_accuracy": correct / max(tokens, 1),
        "tokens": tokens,
        "examples": examples,
    }
    if spread is not None:
        s1, s2, n = spread
        var = (s2 - s1 * s1 / n) / (n - 1) if n > 1 else None
        out["loss_stderr"] = math.sqrt(max(var, 0.0) / n) if var is not None else None
    return out


def evaluate(
    model: Any, examples: list[Example], row_tokens: int, check: Callable[[], None] | None = None
) -> dict[str, float | None]:
    """Token-weighted loss, perplexity and token accuracy over ``examples``, packed in rows of ``row_tokens``."""
    total, tokens, correct, s1, s2, n = eval_sums(model, micro_batches(examples, row_tokens), check)
    return eval_metrics(total, tokens, correct, len(examples), (s1, s2, n))


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """Return the trainable (LoRA) parameters by name, detached on CPU."""
    return {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad}


def lr_lambda(warmup: int, total: int) -> Any:
    """Linear warmup over ``warmup`` steps, then linear decay to 0 at ``total``.

    ``warmup`` comes from ``Hyperparameters.warmup_for(total)`` (``warmup_steps`` or
    ``warmup_ratio``). Returns the ``LambdaLR`` factor function.
    """

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor
