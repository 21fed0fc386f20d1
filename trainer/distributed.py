"""Data parallelism: one trainer process (rank) per GPU, LoRA gradients summed across ranks.

A multi-GPU job is one srun step with one task per GPU; each task runs
``python -m trainer run spec.json`` and learns its place from the environment
(:func:`trainer.jobenv.world_env`). Every rank holds the whole model and the
whole (replicated) LoRA and optimizer state; each optimizer step's micro-batch
rows are dealt out round-robin, every rank backpropagates its rows' summed
loss divided by the step's trained tokens over *all* ranks, and one all-reduce
SUM of the LoRA gradients gives every rank the gradient one process would
have computed (up to float summation order). No DDP wrapper: LoRA gradients
are small, and a manual all-reduce after backward works with peft and
gradient checkpointing alike.

Sharded (``fsdp`` in the spec, :meth:`World.shard`): for a base model too
large for one GPU, PyTorch's FSDP2 (``fully_shard``) shards every decoder
layer's parameters, the 4-bit base included (packed as bfloat16 elements,
``bnb_4bit_quant_storage``, as HF's FSDP-QLoRA recipe does), and so its LoRA
weights and Adam moments, over the ranks, under one root on the decoder
(embeddings, final norm and LM head stay whole: they are called apart and may
share a tied weight); a layer's weights are gathered for its forward (the next
layer's prefetched) and freed after it, gathered again for its backward, and its
LoRA gradients reduce-scattered (summed, not averaged: the loss is already
divided by the step's tokens over all ranks). The model is loaded on the CPU
(:func:`trainer.model.staging_device`) and moved to the GPU a layer at a time,
rank 0's bits broadcast, so no rank holds the whole model on its GPU.
Every rank must then run the same number of forward and backward passes, so a
rank with fewer rows in a step or an eval runs padding passes weighted 0.
Checkpoints gather the (small) LoRA weights and optimizer state to rank 0 and
keep the unsharded format: one checkpoint layout for every world size and mode.

With one rank (every job before data parallelism) nothing here imports
``torch.distributed`` and every helper returns at once: today's behaviour
exactly. With several, a collective that waits longer than
:data:`TIMEOUT_S` (``SFT_DIST_TIMEOUT_S``) for a rank, or finds one gone,
raises :class:`~trainer.contract.errors.PeerError`, so no rank hangs forever on a dead
peer (srun ``--kill-on-bad-exit`` ends the others anyway).

Dropout: every rank reseeds torch's RNG before each optimizer step with
:func:`dropout_seed` of ``(seed, rank, step)``, so ranks drop different units,
and a resumed run draws exactly the masks of an uninterrupted run of the same
world size without any rank's RNG state in the checkpoint. Runs of different
world sizes draw different masks (compare them with ``lora_dropout`` 0).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from trainer.contract.errors import LaunchError, PeerError
from trainer.jobenv import dist_timeout_s, gpu_environment, rendezvous_missing, world_env
from trainer.model import decoder_and_head, trainable_state

if TYPE_CHECKING:
    import torch

TIMEOUT_S = 300.0
"""How long a collective waits for the other ranks (setup skew, rank 0 writing a checkpoint) before failing."""

_STOP_CODES: dict[int, int] = {signal.SIGUSR1.value: 1, signal.SIGTERM.value: 2}  # MAX: a cancel beats a requeue
_STOP_SIGNALS = {code: signum for signum, code in _STOP_CODES.items()}


def dropout_seed(seed: int, rank: int, step: int) -> int:
    """Return the torch seed of ``rank`` before optimizer step ``step`` (0-based): a 63-bit hash, no state."""
    digest = hashlib.sha256(f"dropout:{seed}:{rank}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class World:
    """This process's place among the ranks of one run, and the collectives they share.

    ``World()`` is a single process: every collective is a no-op returning its input.
    """

    def __init__(
        self, rank: int = 0, size: int = 1, local_rank: int = 0, source: str = "a single process",
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.source = source  # the variable the size came from, for the mismatch message
        self.timeout_s = timeout_s
        self._dist: Any = None  # torch.distributed once connected
        self.sharded = False  # FSDP2 over the ranks (shard), else every rank holds everything
        self._device: Any = None  # where the collectives' buffers live (cuda:<local> with NCCL)

    @classmethod
    def from_env(cls) -> World:
        """Return the world described by the job environment (see :func:`trainer.jobenv.world_env`).

        Raises:
            ValueError: a rank variable or ``SFT_DIST_TIMEOUT_S`` is invalid.
        """
        rank, size, local_rank, source = world_env()
        return cls(rank, size, local_rank, source, dist_timeout_s(TIMEOUT_S))

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that writes events, checkpoints and the staging directory."""
        return self.rank == 0

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size}, local_rank={self.local_rank})"

    def check_size(self, wanted: int) -> None:
        """Refuse a launch whose number of ranks is not the spec's ``world_size``.

        Raises:
            LaunchError: the sizes differ (names the variable the launched size came from).
        """
        if wanted != self.size:
            raise LaunchError(
                f"spec asks for {wanted} ranks, this run has {self.size} ({self.source}): "
                "launch one task per rank (srun --ntasks-per-node) or fix world_size in the spec"
            )

    def select_gpu(self, requested: str) -> None:
        """Make ``cuda:<local rank>`` this rank's device before anything touches CUDA (several ranks only).

        With one visible GPU per task (Slurm's binding) that is device 0. Nothing for
        ``device: "cpu"`` or without CUDA (``resolve_device`` then decides).

        Raises:
            LaunchError: the local rank has no GPU of its own among the visible ones.
        """
        if self.size == 1 or requested == "cpu":
            return
        import torch  # lazy: torch

        if not torch.cuda.is_available():
            return
        count = torch.cuda.device_count()
        index = 0 if count == 1 else self.local_rank
        if index >= count:
            raise LaunchError(
                f"local rank {self.local_rank} has no GPU: {count} visible ({gpu_environment()}); "
                "give each task its own GPU (one task per GPU)"
            )
        torch.cuda.set_device(index)

    def connect(self, device: str, sharded: bool = False) -> None:
        """Join the other ranks (NCCL on ``"cuda"``, else gloo; ``env://`` rendezvous at rank 0).

        ``sharded`` with one rank (an FSDP smoke run on one GPU): a process group of
        one in memory, no rendezvous.

        Raises:
            LaunchError: ``MASTER_ADDR``/``MASTER_PORT`` are unset.
            PeerError: the other ranks did not all arrive within the timeout.
        """
        if self._dist is not None or (self.size == 1 and not sharded):
            return
        if self.size == 1:
            import torch  # lazy: torch
            import torch.distributed as dist  # lazy: torch

            backend = "nccl" if device == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._dist = dist
            self._device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
                else torch.device("cpu")
            return

        missing = rendezvous_missing()
        if missing:
            raise LaunchError(
                f"{' and '.join(missing)} unset: a run of {self.size} ranks needs rank 0's address "
                "(the batch script exports MASTER_ADDR and MASTER_PORT)"
            )
        import torch  # lazy: torch
        import torch.distributed as dist  # lazy: torch

        backend = "nccl" if device == "cuda" else "gloo"
        try:
            dist.init_process_group(
                backend, init_method="env://", rank=self.rank, world_size=self.size,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
        except (RuntimeError, ValueError) as e:
            raise self._peer_error("init_process_group", e) from e
        self._dist = dist
        self._device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")

    def _peer_error(self, what: str, e: BaseException) -> PeerError:
        lines = str(e).strip().splitlines()
        first = lines[0][:200] if lines else type(e).__name__  # torch/gloo/NCCL text: addresses, no data
        return PeerError(
            f"{what} failed on rank {self.rank} of {self.size}: another rank died or did not answer within "
            f"{self.timeout_s:g} s ({type(e).__name__}: {first}); see the other ranks' logs"
        )

    def _all_reduce(self, what: str, tensor: torch.Tensor, op: str = "SUM") -> None:
        if self._dist is None:
            raise PeerError(f"{what} on rank {self.rank} of {self.size} before the ranks connected")
        try:
            self._dist.all_reduce(tensor, op=getattr(self._dist.ReduceOp, op))
        except (RuntimeError, ValueError) as e:  # gloo: peer gone at once; gloo/NCCL: timeout
            raise self._peer_error(what, e) from e

    def sum_gradients(self, params: list[Any]) -> None:
        """All-reduce SUM the ``.grad`` of ``params`` in place: one flat buffer, one collective per dtype.

        A parameter without a gradient counts as zeros; it keeps ``grad = None``
        only where no rank had one (as one process would leave it). Sharded:
        only the parameters FSDP does not hold (it reduce-scattered the others in backward).

        Raises:
            PeerError: see :meth:`connect`.
        """
        if self.size == 1:
            return
        import torch  # lazy: torch

        if self.sharded:  # FSDP reduce-scattered the sharded ones in backward
            from torch.distributed.tensor import DTensor  # lazy: torch

            params = [p for p in params if not isinstance(p, DTensor)]
        groups: dict[Any, list[Any]] = {}
        for p in params:
            groups.setdefault(p.dtype, []).append(p)
        for dtype, group in groups.items():
            parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in group]
            flags = torch.tensor([p.grad is not None for p in group], dtype=dtype, device=parts[0].device)
            buffer = torch.cat([*parts, flags])
            self._all_reduce("gradient all-reduce", buffer)
            offset = 0
            for p, had in zip(group, buffer[-len(group):].tolist(), strict=True):
                summed = buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is not None:
                    p.grad.copy_(summed)
                elif had:
                    p.grad = summed.clone()

    def sum_floats(self, values: list[float]) -> list[float]:
        """Return the element-wise sum over ranks of ``values`` (float64; exact for integers < 2**53).

        Raises:
            PeerError: see :meth:`connect`.
        """
        if self.size == 1:
            return values
        import torch  # lazy: torch

        buffer = torch.tensor(values, dtype=torch.float64, device=self._device)
        self._all_reduce("sum", buffer)
        return [float(v) for v in buffer.tolist()]

    def agree_stop(self, signum: int | None) -> int | None:
        """Return the stop signal all ranks act on: the MAX over ranks (SIGTERM beats SIGUSR1), or None.

        Every rank calls it at the same points, so all stop after the same step.

        Raises:
            PeerError: see :meth:`connect`.
        """
        if self.size == 1:
            return signum
        import torch  # lazy: torch

        code = torch.tensor([0 if signum is None else _STOP_CODES.get(signum, 0)], device=self._device)
        self._all_reduce("stop agreement", code, "MAX")
        return _STOP_SIGNALS.get(int(code.item()))

    def all_equal(self, value: int) -> bool:
        """Return whether every rank passed the same ``value`` (MIN == MAX over ranks).

        Raises:
            PeerError: see :meth:`connect`.
        """
        if self.size == 1:
            return True
        import torch  # lazy: torch

        pair = torch.tensor([value, -value], device=self._device)
        self._all_reduce("agreement", pair, "MAX")
        return int(pair[0].item()) == -int(pair[1].item())

    def barrier(self) -> None:
        """Wait until every rank got here (a one-element all-reduce; NCCL and gloo alike).

        Raises:
            PeerError: see :meth:`connect`.
        """
        if self.size == 1 or self._dist is None:
            return
        import torch  # lazy: torch

        self._all_reduce("barrier", torch.zeros(1, device=self._device))

    # -- sharded (FSDP2) -----------------------------------------------------------

    def shard(self, model: Any) -> int:
        """Shard ``model`` over the ranks with FSDP2; return the number of decoder layers sharded.

        Each decoder layer is its own FSDP unit (its base, LoRA weights and Adam moments
        sharded), under one root on the decoder. The root matters: FSDP2 never reshards a
        root after forward, so layers wrapped without one stayed whole on every rank after
        any forward and after every no-grad eval; under a root every layer reshards after
        its forward, the next layer is gathered ahead (forward prefetch) and the previous one
        in backward. The decoder's own parameters (embeddings, final norm) and the LM head
        stay whole on every rank (``ignored_params``): the recipe calls the decoder and the
        head apart (chunked logits) and they may share a tied weight.

        The model may come staged on the CPU (:func:`trainer.model.load_base_model` with
        ``shardable`` on CUDA): each layer is then moved to this rank's device one at a time
        and sharded, so no rank ever holds the whole model on its device. Before sharding,
        every tensor (parameters, buffers and the bitsandbytes ``quant_state`` that is no
        parameter) is broadcast from rank 0, so all ranks shard rank 0's bits
        (what ``sync_module_states`` does for FSDP1), whatever each rank's own load produced.

        Call after LoRA is added and before the optimizer is built (its parameters
        become DTensors). Gradients are summed over ranks, not averaged.

        Raises:
            LaunchError: not connected, the model has no decoder layer list to shard, a
                trainable parameter lies outside the layers, or the ranks loaded different models.
            PeerError: a rank died or did not answer during the broadcast.
        """
        from torch.distributed.fsdp import FSDPModule, fully_shard  # lazy: torch


        if self._dist is None:
            raise LaunchError("fsdp: connect the ranks before sharding the model")
        parts = decoder_and_head(model)
        decoder: Any = parts[0] if parts else None
        layers = getattr(decoder, "layers", None)
        if not layers:
            raise LaunchError("fsdp: this model has no list of decoder layers to shard; train it without fsdp")
        # They must be frozen: gradient clipping cannot mix sharded and whole gradients.
        inside = {id(p) for layer in layers for p in layer.parameters()}
        outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside]
        if outside:
            raise LaunchError(f"fsdp shards the decoder layers only, but {len(outside)} trainable parameters lie "
                              f"outside them ({outside[0]}, ...): leave lm_head and the embeddings out of "
                              "target_modules, or train without fsdp")
        layer_modules = {id(m) for layer in layers for m in layer.modules()}
        rest = [m for m in model.modules() if id(m) not in layer_modules]
        self._place_and_sync(rest, recurse=False)
        for layer in layers:
            self._place_and_sync([layer], recurse=True)  # one whole layer on the device at a time
            fully_shard(layer)
        fully_shard(decoder, ignored_params={p for p in decoder.parameters() if id(p) not in inside})
        for before, after in zip(layers, layers[1:], strict=False):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
        self.sharded = True
        return len(layers)

    def _place_and_sync(self, modules: list[Any], recurse: bool) -> None:
        """Move ``modules``' parameters, buffers and 4-bit quant states to this rank's device, then
        broadcast their bytes from rank 0 (one collective for all of them)."""
        tensors = []
        for module in modules:
            for p in module.parameters(recurse=recurse):
                if p.device != self._device:
                    p.data = p.data.to(self._device)  # in place: a tied weight stays tied
                tensors.append(p.data)
            for owner in (module.modules() if recurse else [module]):
                for name, b in list(owner._buffers.items()):
                    if b is not None:
                        owner._buffers[name] = b = b.to(self._device)
                        tensors.append(b)
                tensors.extend(_quant_state_tensors(owner, self._device))
        self._broadcast_bytes(tensors)

    def _broadcast_bytes(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``tensors`` (contiguous, on this rank's device) with rank 0's, as one byte buffer.

        Raises:
            LaunchError: the ranks' byte counts differ (they loaded different models).
            PeerError: see :meth:`connect`.
        """
        import torch  # lazy: torch

        # byte views of the tensors themselves (a non-contiguous one through a copy written back)
        pairs = [(t, t.detach() if t.is_contiguous() else t.detach().contiguous()) for t in tensors if t.numel()]
        parts = [flat.reshape(-1).view(torch.uint8) for _, flat in pairs]
        size = sum(int(p.numel()) for p in parts)
        if not self.all_equal(size):
            raise LaunchError(f"fsdp: rank {self.rank} loaded another model than rank 0 ({size} bytes in one "
                              "part); every rank must load the same base model")
        if not parts or self.size == 1:
            return
        buffer = torch.cat(parts)
        try:
            self._dist.broadcast(buffer, src=0)
        except (RuntimeError, ValueError) as e:
            raise self._peer_error("model broadcast", e) from e
        offset = 0
        for part in parts:
            part.copy_(buffer[offset : offset + part.numel()])  # a view of the tensor: written in place
            offset += part.numel()
        for tensor, flat in pairs:
            if not tensor.is_contiguous():
                tensor.detach().copy_(flat)

    @contextlib.contextmanager
    def collectives(self, what: str) -> Iterator[None]:
        """Turn a failed collective inside model code (FSDP's gathers and reductions) into PeerError.

        torch.distributed's own errors, and a RuntimeError raised where torch.distributed
        waits on the transport with a lost-peer message (gloo says "Connection closed by
        peer"); any other exception (a bug, out of memory) passes as it is.
        """
        if not self.sharded:
            yield
            return
        import torch.distributed as dist  # lazy: torch

        try:
            yield
        except dist.DistError as e:
            raise self._peer_error(what, e) from e
        except RuntimeError as e:
            if _lost_peer(e):
                raise self._peer_error(what, e) from e
            raise

    def adapter_state(self, model: Any) -> dict[str, Any]:
        """Return the trainable (LoRA) parameters by name, whole, on the CPU.

        Sharded: every rank must call it (a gather); rank 0 gets the tensors, the
        others an empty dict.
        """
        if not self.sharded:
            return trainable_state(model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # lazy: torch

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        with self.collectives("adapter gather"):
            state: dict[str, Any] = dict(get_model_state_dict(model, options=options))
        return {name: t.contiguous() for name, t in state.items()}

    def load_adapter(self, model: Any, state: dict[str, Any]) -> None:
        """Copy ``state`` (name -> whole tensor, as :meth:`adapter_state` returns) into the model.

        Sharded: every rank must call it; rank 0's ``state`` is scattered to the others.
        """
        import torch  # lazy: torch

        if not self.sharded:
            named = dict(model.named_parameters())
            with torch.no_grad():
                for name, value in state.items():
                    named[name].copy_(value)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # lazy: torch

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        with self.collectives("adapter load"):
            set_model_state_dict(model, state if self.is_main else {}, options=options)

    def optimizer_state(self, model: Any, optimizer: Any) -> dict[str, Any]:
        """Return ``optimizer.state_dict()``, whole (sharded: gathered to rank 0, every rank calls; others get {}).

        The sharded state is put back into the unsharded layout (parameters by index,
        in ``model.named_parameters()`` order), so every checkpoint has one format.
        """
        if not self.sharded:
            return dict(optimizer.state_dict())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # lazy: torch

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        with self.collectives("optimizer gather"):
            state: Any = get_optimizer_state_dict(model, optimizer, options=options)
        if not self.is_main:
            return {}
        index = {name: i for i, name in enumerate(_trainable_names(model))}
        return {
            "state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
        }

    def load_optimizer(self, model: Any, optimizer: Any, state: dict[str, Any]) -> None:
        """Load an optimizer state of :meth:`optimizer_state`'s layout (sharded: every rank calls; rank 0's counts)."""
        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict  # lazy: torch

        names = _trainable_names(model)
        by_name: Any = {
            "state": {names[int(i)]: value for i, value in state["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]],
        } if self.is_main else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        with self.collectives("optimizer load"):
            set_optimizer_state_dict(model, optimizer, by_name, options=options)

    def close(self) -> None:
        """Leave the process group (after the last barrier; a run that failed just exits)."""
        if self._dist is not None and self._dist.is_initialized():
            self._dist.destroy_process_group()
        self._dist = None


_LOST_PEER = ("connection closed", "connection reset", "timed out", "timeout", "broken pipe")


def _lost_peer(e: RuntimeError) -> bool:
    """Whether ``e`` is a transport failure of a collective: raised in torch.distributed, naming a lost link."""
    tb, where = e.__traceback__, ""
    while tb is not None:
        where, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    text = str(e).lower()
    return "/torch/distributed/" in where.replace("\\", "/") and any(s in text for s in _LOST_PEER)


def _quant_state_tensors(module: Any, device: Any) -> list[Any]:
    """Move a bitsandbytes 4-bit module's quant state (absmax, code, nested statistics: no parameter,
    so FSDP neither moves nor shards it) to ``device`` in place; return its tensors (none for others)."""
    states = {id(s): s for s in (getattr(module, "quant_state", None),
                                 getattr(getattr(module, "weight", None), "quant_state", None)) if s is not None}
    tensors = []
    for state in states.values():
        if not hasattr(state, "absmax"):
            continue  # not a bitsandbytes QuantState
        state.to(device)
        tensors += [state.absmax, state.code]
        if getattr(state, "nested", False):
            tensors += [state.offset, state.state2.absmax, state.state2.code]
    return tensors


def _trainable_names(model: Any) -> list[str]:
    """The trainable parameters' names in ``named_parameters`` order: the optimizer's index order."""
    return [name for name, p in model.named_parameters() if p.requires_grad]
