"""A traced step's roofline time: every kernel the step launches, timed on a named GPU.

`KernelTimes` is a dispatch mode that sees each aten op of a step on fake tensors and adds up
its kernel's roofline time (`autotune.core.gpus.roofline.op_time_s`): FLOPs from torch's
formulas (`torch.utils.flop_counter`), bytes read and written from the shapes: what it reads,
what it returns and what it writes in place (`written_arguments`: an in-place foreach kernel or
a fused optimizer returns nothing). Views and allocations launch no kernel. `SpeedPass` is the
step's view from above the dispatcher: attention as the GPU's fused kernel, and where each
micro-step ends. The estimate times its speed passes with both (`autotune.engine.estimate`);
the layer replay times a shallow model's step with a `KernelTimes` that also says which layer
each kernel belongs to (`autotune.engine.replay.layer_speed`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop,
    sdpa_flop,
)

from autotune.core.gpus.cuda_reserve import GpuBudget
from autotune.core.gpus.roofline import MathDtype, RooflineAssumptions, op_time_s
from autotune.engine.emulation.tracker import local_tensor

_aten = torch.ops.aten

# The CPU's flash attention stands for the GPU's fused kernels in the speed pass; torch has no
# FLOP formula for it, and the SDPA formulas count what a fused kernel computes.
for _op, _formula in (
    (_aten._scaled_dot_product_flash_attention_for_cpu, sdpa_flop),
    (_aten._scaled_dot_product_flash_attention_for_cpu_backward, sdpa_backward_flop),
):
    if _op not in flop_registry:
        register_flop_formula(_op, get_raw=True)(_formula)

# Ops that launch no kernel: they only make a tensor's metadata or reserve its memory.
# `_unsafe_view` is a view aten does not mark as one (autograd sees no alias): matmul reshapes
# every linear's mm result of a 3-d input with it.
_NO_KERNEL = {
    _aten._unsafe_view.default,
    _aten.empty.memory_format,
    _aten.empty_like.default,
    _aten.empty_strided.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten.detach.default,
}


# Fused optimizers whose schema marks the gradients written: CUDA's fused Adam and Adagrad
# kernels store them back only when they unscale them, with a `grad_scale` given.
_GRADS_WRITTEN_WITH_SCALE = {
    _aten._fused_adam_,
    _aten._fused_adamw_,
    _aten._fused_adagrad_,
}

# Ops that launch one kernel over lists of tensors, one per parameter (torch's
# multi_tensor_apply): the foreach ops (by name) and the fused optimizers.
_FUSED_OPTIMIZERS = {*_GRADS_WRITTEN_WITH_SCALE, _aten._fused_sgd_}


def is_multi_tensor(func: Any) -> bool:
    """Whether `func` is one launch over lists of tensors: a foreach op or a fused optimizer."""
    return bool(func.__name__.startswith("_foreach_") or func._overloadpacket in _FUSED_OPTIMIZERS)


class _Arguments(NamedTuple):
    """What `KernelTimes` reads off an op's schema, once an op (every op of a step asks)."""

    names: tuple[str, ...]
    written: tuple[int, ...]  # written in place and not returned (`written_arguments`)
    outs: frozenset[int]  # `out=` arguments: written, not read
    grads_need_scale: int | None  # the `grads` a fused optimizer writes only with a grad_scale


@functools.cache
def _arguments(func: Any) -> _Arguments:
    arguments = func._schema.arguments
    returned: set[str] = set()
    for result in func._schema.returns:
        if result.alias_info is not None:
            returned |= result.alias_info.before_set
    written = tuple(
        position
        for position, argument in enumerate(arguments)
        if argument.alias_info is not None
        and argument.alias_info.is_write
        and not argument.alias_info.before_set & returned
    )
    names = tuple(argument.name for argument in arguments)
    grads = (
        names.index("grads")
        if func._overloadpacket in _GRADS_WRITTEN_WITH_SCALE and "grads" in names
        else None
    )
    outs = frozenset(position for position, argument in enumerate(arguments) if argument.is_out)
    return _Arguments(names, written, outs, grads)


def _value(
    arguments: _Arguments, position: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    return args[position] if position < len(args) else kwargs.get(arguments.names[position])


def written_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments an aten op writes in place and does not return (`(a!)` in its schema, a
    list as it is): what an in-place foreach op or a fused optimizer writes, which returns
    nothing. An argument it also returns (`add_`'s self, an `out=`) is its output once, as
    returned, not again here."""
    arguments = _arguments(func)
    if not arguments.written:
        return []
    if (
        arguments.grads_need_scale is not None
        and _value(arguments, arguments.names.index("grad_scale"), args, kwargs) is None
    ):
        skipped: int | None = arguments.grads_need_scale  # read only (above)
    else:
        skipped = None
    return [
        _value(arguments, position, args, kwargs)
        for position in arguments.written
        if position != skipped
    ]


def _read(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What `func` reads: its arguments but its `out=` ones (an in-place op's self is both)."""
    if not kwargs:
        arguments = _arguments(func)
        if not arguments.outs:
            return args  # the schema's order, as below
    arguments = _arguments(func)
    return [
        _value(arguments, position, args, kwargs)
        for position in range(len(arguments.names))
        if position not in arguments.outs
    ]


def _math_dtype(dtype: torch.dtype, *, tf32: bool) -> MathDtype:
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "tf32" if tf32 else "fp32"


@dataclass(frozen=True)
class Kernel:
    """One kernel an op launches: its arithmetic, the tensors it reads and writes, and the
    dtype its arithmetic runs in."""

    flops: int
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    dtype: MathDtype

    @property
    def bytes_moved(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.inputs, *self.outputs))


def _fsdp_copy(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: object, *, tf32: bool
) -> Kernel | None:
    """The copy kernel of one of FSDP2's own ops around its collectives
    (docs/design.md#the-copies-around-fsdp2s-collectives): what it reads and writes.

    They are ops of FSDP2's library, not aten's, and two return nothing (they write into
    `out`), so the aten rule above would time none of them; on a GPU each is one kernel
    (`_foreach_copy_`, `split_with_sizes_copy`, `_chunk_cat`) moving every byte it copies."""
    name = func._opname
    if name == "all_gather_copy_in":
        # This rank's shards into its slice of the all-gather's input (the first output).
        inputs, outputs = list(args[0]), [out[0]] if isinstance(out, tuple) else []
    elif name == "split_with_sizes_copy":
        # The whole gathered buffer into every parameter's unsharded tensor.
        inputs, outputs = [args[0]], list(kwargs["out"])
    elif name == "chunk_cat":
        # The unsharded gradients into the reduce-scatter's input.
        inputs, outputs = list(args[0]), [kwargs["out"]]
    else:
        return None
    floating = [t.dtype for t in outputs if t.is_floating_point()]
    dtype = _math_dtype(floating[0] if floating else torch.float32, tf32=tf32)
    return Kernel(0, inputs, outputs, dtype)


class KernelTimes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Adds up every kernel's roofline time on `budget`'s GPU; `ends_s` is the running total
    at the end of each micro-step (`SpeedPass`)."""

    def __init__(self, budget: GpuBudget, assumptions: RooflineAssumptions, tf32: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.gpu = budget.gpu
        self.assumptions = assumptions
        self.tf32 = tf32
        self.time_s = 0.0
        self.ends_s: list[float] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Out of torch's guard around a mode's __torch_dispatch__, as the trackers are
        # (`autotune.engine.emulation.tracker.LiveBytesTracker`): no step runs compiled.
        return False

    def kernel_time_s(self, kernel: Kernel, bytes_moved: int | None = None) -> float:
        """`kernel`'s roofline time, moving `bytes_moved` (its own tensors' by default)."""
        return op_time_s(
            self.gpu,
            self.assumptions,
            flops=kernel.flops,
            bytes_moved=kernel.bytes_moved if bytes_moved is None else bytes_moved,
            dtype=kernel.dtype,
        )

    def kernel(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: object
    ) -> Kernel | None:
        """The kernel `func` launched to make `out` (and to write its arguments in place,
        `written_arguments`); None for a view, an allocation or an op that neither returns nor
        writes a tensor."""
        if func.namespace == "fsdp":
            return _fsdp_copy(func, args, kwargs, out, tf32=self.tf32)
        if func.namespace != "aten" or func.is_view or func in _NO_KERNEL:
            return None
        written = written_arguments(func, args, kwargs)
        # A DTensor (an FSDP2 rank's sharded parameters, gradients and optimizer states, which
        # the optimizer's foreach kernels run over) is its global shape: the rank's kernel
        # moves its local shard.
        outputs = [
            local_tensor(t)
            for t in pytree.tree_leaves((out, written))
            if isinstance(t, torch.Tensor)
        ]
        if not outputs:
            return None
        inputs = [
            local_tensor(t)
            for t in pytree.tree_leaves(_read(func, args, kwargs))
            if isinstance(t, torch.Tensor)
        ]
        if is_multi_tensor(func) and all(t.dim() == 0 for t in (*inputs, *outputs)):
            # The optimizer's step counters: a CUDA run keeps them on the CPU (neither
            # capturable nor fused, as the step builds it), where incrementing them launches
            # no GPU kernel.
            return None
        formula = flop_registry.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        floating = [t.dtype for t in (*inputs, *outputs) if t.is_floating_point()]
        dtype = _math_dtype(floating[0] if floating else torch.float32, tf32=self.tf32)
        return Kernel(flops, inputs, outputs, dtype)

    def record(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: object
    ) -> None:
        """Counts what `func` launched; a subclass may file it elsewhere."""
        kernel = self.kernel(func, args, kwargs, out)
        if kernel is not None:
            self.time_s += self.kernel_time_s(kernel)

    def end_micro_step(self) -> None:
        self.ends_s.append(self.time_s)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out


class SpeedPass(TorchFunctionMode):
    """The speed pass's view of the step's calls: attention as the fused kernel, and the end of
    each micro-step.

    Dropout sends the CPU's attention down the math path (s x s matrices the GPU's kernels
    never write); the fused kernels apply it on chip, so the speed pass runs without it. The step
    calls `torch.autograd.backward` once per micro-batch: `times` is told as each returns, the
    kernels between two ends being one micro-step's forward and backward.

    `alters=False` leaves dropout as it is, for a step traced for its memory too (whose trial
    keeps what the step's own attention keeps): `altered` then says whether a call had dropout
    the speed pass would have taken out, which makes the times not the speed pass's."""

    def __init__(self, times: KernelTimes, *, alters: bool = True) -> None:
        super().__init__()
        self.times = times
        self.alters = alters
        self.altered = False
        self.micro_steps = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            if not self.alters:
                dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
                self.altered = self.altered or dropout_p != 0.0
            else:
                kwargs["dropout_p"] = 0.0
                if len(args) > 4:
                    args = (*args[:4], 0.0, *args[5:])
        out = func(*args, **kwargs)
        if func is torch.autograd.backward:
            self.micro_steps += 1
            self.times.end_micro_step()
        return out


__all__ = ["Kernel", "KernelTimes", "SpeedPass", "is_multi_tensor", "written_arguments"]
