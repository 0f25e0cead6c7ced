"""The one training-step kernel: forward, backward and optimizer step of a `Workload`.

The memory probe and the tuner's throughput timing both run `TrainingStep.run`, so what is
measured is what is timed. The optimizer and precision are set up the way a CUDA run sets them
up, because the CPU defaults differ and change the peak (docs/design.md#memory-model).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.amp.grad_scaler import _refresh_per_optimizer_state
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import _disable_current_modes

from autotune.core.errors import SpecError
from autotune.core.memory.optimizer_states import FSDP2_SHARDINGS, Library, eight_bit_adamw
from autotune.core.schemas import OptimizerName, Precision, Sharding, TrainingSpec, WeightsDtype
from autotune.engine.emulation.autocast import cuda_autocast_policy
from autotune.engine.emulation.tracker import MemoryHolders
from autotune.engine.training.adamw_8bit import AdamW8bit, assumption
from autotune.engine.training.adapters import adapter_parameter_ids, apply_lora
from autotune.engine.training.data_parallel import EmulatedReducer
from autotune.engine.training.sharding import assumption as sharding_assumption
from autotune.engine.training.sharding import initialise as initialise_fsdp
from autotune.engine.training.sharding import process_group, shard_model, zero1_optimizer
from autotune.engine.training.workload import Batch, Workload, cast_weights, fp32_on

# Learning rates only have to keep long timing runs finite; they change neither memory nor time.
_LEARNING_RATES = {
    OptimizerName.ADAMW: 1e-4,
    OptimizerName.SGD: 1e-3,
    OptimizerName.ADAFACTOR: 1e-3,
    OptimizerName.ADAMW_8BIT: 1e-4,
}
_AUTOCAST_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def accumulate_gradients(
    model: nn.Module,
    loss_sum: Callable[[nn.Module, Batch], torch.Tensor],
    num_items: Callable[[Batch], int | torch.Tensor],
    batches: Sequence[Batch],
    *,
    autocast_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    reducer: EmulatedReducer | None = None,
) -> torch.Tensor:
    """Backward over every micro-batch of one optimizer step, leaving the step's gradients in
    ``.grad``; returns the step loss (detached).

    Each micro-batch's summed loss is divided by the item count of ALL micro-batches of the step,
    so the accumulated gradient equals the full-batch gradient whatever the lengths. Dividing
    each micro-batch by its own count and then by G (mean of means) is the gradient-accumulation
    bug fixed across the ecosystem in October 2024 (docs/design.md#loss-normalisation).

    With a `reducer` (world_size > 1) each micro-batch runs as under DDP: only the last one
    synchronises, the others run as under `no_sync()` (docs/design.md#data-parallel).
    """
    # A step whose labels are all padding has a zero loss; dividing by 1 keeps it zero, not NaN.
    counted = sum(num_items(batch) for batch in batches)
    total_items = counted.clamp(min=1) if isinstance(counted, torch.Tensor) else max(counted, 1)
    device = _model_device(model)
    step_loss = torch.zeros((), device=device)
    # On the CPU (the emulated GPU) autocast casts as on CUDA, through backward too: checkpoint
    # recomputation re-enters autocast there (docs/design.md#autocast-on-the-emulated-gpu).
    with _cuda_autocast_policy(device.type, autocast_dtype):
        for index, batch in enumerate(batches):
            with _data_parallel(reducer, first=index == 0, sync=index == len(batches) - 1):
                with _autocast(device.type, autocast_dtype):
                    loss = loss_sum(model, batch) / total_items
                scaled: torch.Tensor = scaler.scale(loss) if scaler is not None else loss
                torch.autograd.backward(scaled)  # Tensor.backward is untyped in torch 2.13
                step_loss += loss.detach()
                # Drop the graph's root before the next forward, as a loop would.
                del loss, scaled
    return step_loss


@dataclass(frozen=True)
class StateSnapshot:
    """A CPU copy of the model's and the optimizer's state (and the gradient scaler's)."""

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    scaler_state: dict[str, Any] | None


class TrainingStep:
    """Runs complete optimizer steps of a workload on one device, as one rank of
    `training.world_size` runs them.

    The model is moved to `device` and put in training mode; the optimizer is created here, with
    `foreach=True` as on CUDA. With world_size > 1 an `EmulatedReducer` adds what DDP keeps per
    rank (gradient buckets, gradients as their views once synchronised). Precision: fp32 runs
    as is; bf16 runs the forward under `torch.autocast(dtype=bfloat16)`; fp16 under
    `torch.autocast(dtype=float16)` with a `GradScaler`. On the CPU (the emulated GPU)
    autocast follows CUDA's op lists (`autotune.engine.emulation.autocast`). Weights stay fp32 (the
    master copy) unless `training.weights` is bf16.
    """

    def __init__(self, workload: Workload, training: TrainingSpec, device: torch.device) -> None:
        self._workload = workload
        self._device = device
        self.model = fp32_on(workload.model, device).train()
        if training.lora is not None:
            # Adapters before the cast, as a script adds them to the model it loaded: peft makes
            # them on the base layers' device, and keeps them fp32 on a bf16 base.
            self.model = apply_lora(self.model, training.lora).train()
        if training.weights is WeightsDtype.BF16:
            # No fp32 master copy: what from_pretrained(torch_dtype=torch.bfloat16) trains.
            self.model = cast_weights(
                self.model, torch.bfloat16, keep=adapter_parameter_ids(self.model)
            )
        sharded = training.sharding in FSDP2_SHARDINGS
        if sharded:
            self.model = shard_model(self.model, training, device)
            if device.type != "cuda":
                initialise_fsdp(self.model)
        elif training.sharding is Sharding.ZERO1:
            process_group(training.world_size)
        self.optimizer = _build_optimizer(self.model, training.optimizer, training.sharding)
        # What holds this rank's optimizer state: ZeRO-1's local optimizer, else the optimizer.
        self._local_optimizer: torch.optim.Optimizer = getattr(
            self.optimizer, "optim", self.optimizer
        )
        self._autocast_dtype = _AUTOCAST_DTYPES.get(training.precision)
        self.scaler = (
            torch.amp.GradScaler(device.type) if training.precision is Precision.FP16 else None
        )
        if training.tf32 is not None:
            # Process-wide switches; a CUDA build reads them at each matmul and convolution, a
            # CPU build keeps them unused. A session runs one spec, so setting them is its own.
            precision = "tf32" if training.tf32 else "ieee"
            torch.backends.cuda.matmul.fp32_precision = precision
            torch.backends.cudnn.conv.fp32_precision = precision  # type: ignore[attr-defined]
        self._checkpointing = False
        if workload.set_checkpointing is not None:
            workload.set_checkpointing(False)
        self.reducer = (
            EmulatedReducer(self.model) if training.world_size > 1 and not sharded else None
        )
        # What the step counts beyond the device's own accounting, for the result to state.
        self.assumptions: tuple[str, ...] = (
            (self.reducer.assumption(training.world_size),) if self.reducer is not None else ()
        )
        if training.sharding is not Sharding.NONE:
            self.assumptions += (sharding_assumption(training),)
        if isinstance(self._local_optimizer, AdamW8bit):
            self.assumptions += (assumption(self._local_optimizer.library),)

    @property
    def checkpointing(self) -> bool:
        return self._checkpointing

    @checkpointing.setter
    def checkpointing(self, enabled: bool) -> None:
        if self._workload.set_checkpointing is None:
            if enabled:
                raise SpecError(
                    "checkpointing: this model does not support gradient checkpointing "
                    "(its Workload has no set_checkpointing)"
                )
            return
        self._workload.set_checkpointing(enabled)
        self._checkpointing = enabled

    @property
    def num_blocks(self) -> int | None:
        """Blocks whose checkpointing can be set one by one (None: all or nothing)."""
        partial = self._workload.partial_checkpointing
        return partial.num_blocks if partial is not None else None

    def checkpoint_blocks(self, count: int | None) -> None:
        """While checkpointing is on, checkpoint only the first `count` blocks (None: all).

        Raises:
            SpecError: the model checkpoints all of its blocks or none.
            ValueError: `count` is not in [1, num_blocks].
        """
        partial = self._workload.partial_checkpointing
        if count is None:
            if partial is not None:
                partial.limit(None)
            return
        if partial is None:
            raise SpecError(
                "checkpointing: this model checkpoints all of its blocks or none (its Workload "
                "has no partial_checkpointing)"
            )
        if not 1 <= count <= partial.num_blocks:
            raise ValueError(f"checkpointed blocks must be in [1, {partial.num_blocks}]: {count}")
        partial.limit(count)

    def run(self, micro_batch: int, accumulation_steps: int = 1) -> float:
        """One complete optimizer step over `accumulation_steps` micro-batches of `micro_batch`
        samples. All micro-batches are made first (inputs only, small), as transformers'
        Trainer prefetches them, so that the loss can be normalised by the step's item count.
        Returns the step loss."""
        if micro_batch < 1 or accumulation_steps < 1:
            raise ValueError(
                f"micro_batch and accumulation_steps must be >= 1, got "
                f"{micro_batch} and {accumulation_steps}"
            )
        batches = [
            self._workload.make_batch(micro_batch, self._device) for _ in range(accumulation_steps)
        ]
        step_loss = accumulate_gradients(
            self.model,
            self._workload.loss_sum,
            self._workload.num_items,
            batches,
            autocast_dtype=self._autocast_dtype,
            scaler=self.scaler,
            reducer=self.reducer,
        )
        del batches
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # A step on fake tensors (the estimate) has no loss to read.
        return float("nan") if is_fake(step_loss) else float(step_loss)

    def settle(self) -> None:
        """After the first complete step, outside any trial: DDP's reducer rebuilds its buckets
        now rather than inside the next trial, where the caller's list of resident tensors
        would keep the old buckets alive beside the new ones."""
        if self.reducer is not None:
            self.reducer.rebuild_if_due()

    def memory_holders(self) -> MemoryHolders:
        """The weights, gradients and optimizer state as they are now, for an out-of-memory's
        detail."""
        parameters = list(self.model.parameters())
        state = [
            value
            for values in self._local_optimizer.state.values()
            for value in values.values()
            if isinstance(value, torch.Tensor)
        ]
        return MemoryHolders(
            weights=[*parameters, *self.model.buffers()],
            gradients=[p.grad for p in parameters if p.grad is not None],
            optimizer_state=state,
        )

    def resident_tensors(self) -> list[torch.Tensor]:
        """Tensors that live across steps: parameters, buffers, gradients, optimizer state, the
        gradient scaler's state and DDP's gradient buckets. Tied parameters appear once."""
        tensors: list[torch.Tensor] = list(self.model.parameters())
        if self.reducer is not None:
            tensors += self.reducer.buckets
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        tensors += list(self.model.buffers())
        for state in self._local_optimizer.state.values():
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
        if self.scaler is not None:
            # Private attributes, but the only handle on the scaler's device tensors.
            tensors += [
                t for t in (self.scaler._scale, self.scaler._growth_tracker) if t is not None
            ]
        return tensors

    def snapshot(self) -> StateSnapshot:
        """A CPU copy of the model, optimizer and scaler state, to undo a step."""
        scaler_state = None
        if self.scaler is not None and self.scaler._scale is not None:
            scaler_state = self.scaler.state_dict()
        # Host memory, not the device's: a dispatch mode that counts device memory (the
        # simulated CUDA backend, whose device tensors are CPU tensors too) must not see it.
        with _disable_current_modes():
            return StateSnapshot(
                model_state=_copy_to_cpu(self.model.state_dict()),
                optimizer_state=_copy_to_cpu(self._local_optimizer.state_dict()),
                scaler_state=scaler_state,
            )

    def restore(self, snapshot: object) -> None:
        """Put back a snapshot from `snapshot()`, e.g. after an OOM inside `optimizer.step()`
        left the parameters half updated. The snapshot stays valid for another restore."""
        if not isinstance(snapshot, StateSnapshot):
            raise TypeError(f"expected a StateSnapshot, got {type(snapshot).__name__}")
        self.clear_grads()
        self.model.load_state_dict(snapshot.model_state)  # copies in place: params keep identity
        # load_state_dict keeps CPU tensors as they are, so give it copies, or the next step
        # would update the snapshot in place.
        self._local_optimizer.load_state_dict(_copy_to_cpu(snapshot.optimizer_state))
        if self.scaler is not None and snapshot.scaler_state is not None:
            self.scaler.load_state_dict(snapshot.scaler_state)

    def reset_optimizer(self) -> None:
        """Forget the optimizer's state, as before its first step. torch optimizers build their
        state lazily inside the first `step()`, one tensor at a time: running out of memory there
        leaves a parameter with part of it (AdamW's `exp_avg` without `exp_avg_sq`), and every
        later step raises KeyError. With nothing to restore yet, the empty state is the undo."""
        self._local_optimizer.state.clear()

    def clear_grads(self) -> None:
        """Drop all gradients (after an OOM, so that a failed step leaves nothing behind), the
        gradient scaler's record of this step, and FSDP2's: a forward or backward cut short
        leaves blocks' parameters gathered (the next step would start with them registered as
        the model's, and count them as resident), which torch's `reset_iter_state` reshards."""
        self.optimizer.zero_grad(set_to_none=True)
        fsdp_state = getattr(self.model, "_get_fsdp_state", None)  # an FSDP2-sharded root
        # FSDP2 sets up its iteration state in the first forward (`_is_root` is None before).
        if fsdp_state is not None and fsdp_state()._is_root:
            self.model.reset_iter_state()  # type: ignore[operator]
            _drop_unreduced_grads(self.model)
        if self.scaler is not None:
            # `scaler.step()` marks the optimizer UNSCALED before `optimizer.step()` runs, and
            # only `update()` forgets it. After an out-of-memory inside the step, the next step
            # would skip unscale_ and apply gradients still multiplied by the scale (2^16), with
            # the failed step's inf checks (review item 8 of issue 9). What update() does to
            # the per-optimizer records, without touching the scale.
            self.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def _drop_unreduced_grads(model: nn.Module) -> None:
    """Drop the gradients a backward cut short left on FSDP2's gathered parameters.

    FSDP2 moves a block's gradients into its reduce-scatter after the block's backward and then
    sets its gathered parameters' `.grad` to None; a backward that ran out inside a block leaves
    them there, and `reset_iter_state` (which discards in-flight reductions) does not touch
    them. The next step's backward would then accumulate into them out of place (a new
    gradient, then the stale one freed) instead of making them fresh: a trial would depend on
    the one before it."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    if hasattr(fsdp_param, "_unsharded_param"):
                        fsdp_param._unsharded_param.grad = None
                    fsdp_param.unsharded_accumulated_grad = None


def _build_optimizer(
    model: nn.Module, name: OptimizerName, sharding: Sharding = Sharding.NONE
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer_class, kwargs = _optimizer_class(name, params, sharding)
    kwargs["lr"] = _LEARNING_RATES[name]
    if sharding is Sharding.ZERO1:
        return zero1_optimizer(params, optimizer_class, **kwargs)
    return optimizer_class(params, **kwargs)


def _optimizer_class(
    name: OptimizerName, params: list[nn.Parameter], sharding: Sharding
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The class and keyword arguments (but the learning rate) to build `name` with, as a CUDA
    run builds it (`foreach=True`)."""
    if name is OptimizerName.ADAMW:
        return torch.optim.AdamW, {"foreach": True}
    if name is OptimizerName.SGD:
        return torch.optim.SGD, {"momentum": 0.9, "foreach": True}
    if name is OptimizerName.ADAFACTOR:
        return torch.optim.Adafactor, {"foreach": True}
    library = eight_bit_adamw(sharding).library
    return _adamw_8bit_class(params, library)


def _adamw_8bit_class(
    params: list[nn.Parameter], library: Library
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """`library`'s own AdamW8bit where it runs (a CUDA device with the library installed), else
    the allowance that allocates its states (`autotune.engine.training.adamw_8bit`)."""
    if params and params[0].device.type == "cuda":
        try:
            module = importlib.import_module(f"{library}.optim")
        except ImportError:
            pass
        else:
            optimizer_class: type[torch.optim.Optimizer] = module.AdamW8bit
            return optimizer_class, {}
    return AdamW8bit, {"library": library}


def _autocast(
    device_type: str, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def _data_parallel(
    reducer: EmulatedReducer | None, *, first: bool, sync: bool
) -> contextlib.AbstractContextManager[Any]:
    if reducer is None:
        return contextlib.nullcontext()
    return reducer.micro_batch(first=first, sync=sync)


def _cuda_autocast_policy(
    device_type: str, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any]:
    if dtype is None or device_type != "cpu":
        return contextlib.nullcontext()
    return cuda_autocast_policy()


def _model_device(model: nn.Module) -> torch.device:
    return next(itertools.chain(model.parameters(), model.buffers())).device


def _copy_to_cpu(value: Any) -> Any:
    """A deep copy with every tensor copied to the CPU (never aliased, even if already there)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _copy_to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy_to_cpu(item) for item in value)
    return value
