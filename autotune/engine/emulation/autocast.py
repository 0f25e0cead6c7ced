"""CUDA's autocast policy on the emulated GPU: which ops run in 16 bits, which in fp32.

On a GPU, `torch.autocast("cuda", dtype)` decides per op whether its floating inputs are cast to
the autocast dtype, to fp32, or to the widest of them; on the CPU, `torch.autocast("cpu", dtype)`
does the same from different lists (docs/design.md#autocast-on-the-emulated-gpu). CUDA runs
layer_norm, softmax, log_softmax, pow, exp, sum and the losses in fp32 and keeps cross-entropy
as its parts (log_softmax, nll_loss); the CPU casts none of the first six and casts
cross-entropy as one op. The dtypes of the activations saved for backward, and with them the
peak, follow these lists, so the emulated GPU has to use CUDA's.

`cuda_autocast_policy()` is a context in which CPU autocast applies CUDA's policy: for every op
on CUDA's lists (torch 2.13, `CUDA_POLICY`), a Python kernel on the `AutocastCPU` dispatch key
casts as CUDA's kernel would (CPU tensors standing in for CUDA ones, the CPU autocast dtype for
CUDA's); every op only the CPU lists gets a fallthrough, so it runs as CUDA runs it, uncast. The
kernels live in a `torch.library.Library` created on entry and destroyed on exit, which puts
torch's own CPU kernels back: outside the context the process is unchanged.

Why the dispatch key rather than a `TorchFunctionMode` or a dispatch mode: `torch.autocast("cpu",
dtype)` stays the switch, so everything that saves and restores the autocast state keeps
working unchanged, checkpoint recomputation above all (it re-enters autocast with the state of
the forward, and then runs under the same kernels). The casts happen above autograd, as CUDA's
do, so autograd saves the cast tensors; a function mode would miss the composite ops' inner
calls (cross_entropy's log_softmax), and a dispatch mode sits below autograd, too late to change
what autograd saves.

CUDA's cast cache is reproduced: casts of fp32 leaf tensors that require grad (the weights) to
the autocast dtype are cached until the outermost autocast region exits, as torch's
`cached_cast` does (`torch.clear_autocast_cache`, which `torch.autocast` calls on that exit, is
wrapped while the context is active to clear this cache too).

Thread-safety: the kernels are process-wide while any thread is inside the context; nested and
concurrent entries share one registration.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from autotune.engine.emulation.cuda_autocast_lists import (
    APPEND_DTYPE_TARGETS,
    CUDA_POLICY,
    CastPolicy,
)
from autotune.engine.emulation.fused_softmax import softmax_half_to_float

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


# ---------------------------------------------------------------------------------------------
# The cast cache (torch's `cached_cast`): weights cast once per autocast region.


class _CastCache:
    """fp32 leaf tensors that require grad -> their autocast-dtype copy, until cleared."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(source) -> (weakref to the source, its cast). The weakref's callback drops the
        # entry before the id can be reused, as torch's weak TensorImpl pointer does.
        self._casts: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = id(tensor)
        with self._lock:
            entry = self._casts.get(key)
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        casted = tensor.to(dtype)
        with self._lock:
            self._casts[key] = (weakref.ref(tensor, lambda _: self._drop(key)), casted)
        return casted

    def _drop(self, key: int) -> None:
        with self._lock:
            self._casts.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._casts.clear()


_CACHE = _CastCache()


def _is_eligible(tensor: torch.Tensor) -> bool:
    """torch's `is_eligible` for CUDA, with the CPU standing in for the GPU."""
    return (
        tensor.is_floating_point()
        and tensor.device.type == "cpu"
        and tensor.dtype != torch.float64
    )


def _cached_cast(tensor: torch.Tensor, dtype: torch.dtype, lower: torch.dtype) -> torch.Tensor:
    if not _is_eligible(tensor) or tensor.dtype == dtype:
        return tensor
    cacheable = (
        dtype == lower
        and tensor.dtype == torch.float32
        and tensor.requires_grad
        and tensor.is_leaf
        and not tensor._is_view()
        and torch.is_autocast_cache_enabled()
        and not torch._C._is_cached_tensor(tensor)  # type: ignore[attr-defined]
    )
    return _CACHE.cast(tensor, dtype) if cacheable else tensor.to(dtype)


# The ops whose fp16 -> fp32 call CUDA fuses, and whether each is the log variant.
_HALF_TO_FLOAT_LOG = {"softmax.int": False, "log_softmax.int": True}


# ---------------------------------------------------------------------------------------------
# Kernels, one per policy, built from the op's schema.


@dataclass(frozen=True)
class _Signature:
    """Where an op's arguments go: positional or keyword-only, their defaults, and which ones
    autocast casts (Tensor, Tensor? and Tensor[]; torch's `cached_cast` skips Tensor?[])."""

    names: tuple[str, ...]
    kwarg_only: tuple[bool, ...]
    defaults: tuple[Any, ...]
    castable: tuple[bool, ...]

    @classmethod
    def of(cls, op: torch._ops.OpOverload) -> _Signature:
        arguments = op._schema.arguments
        return cls(
            names=tuple(a.name for a in arguments),
            kwarg_only=tuple(a.kwarg_only for a in arguments),
            defaults=tuple(a.default_value if a.has_default_value() else None for a in arguments),
            castable=tuple(_is_castable(a.type) for a in arguments),
        )

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        """Every argument's value in schema order; the dispatcher leaves out trailing defaults."""
        values = list(args)
        for index in range(len(values), len(self.names)):
            values.append(kwargs.get(self.names[index], self.defaults[index]))
        return values

    def call(self, op: Callable[..., Any], values: Sequence[Any]) -> Any:
        args = [v for v, kw in zip(values, self.kwarg_only, strict=True) if not kw]
        kwargs = {n: v for n, v, kw in zip(self.names, values, self.kwarg_only, strict=True) if kw}
        return op(*args, **kwargs)


def _is_castable(jit_type: Any) -> bool:
    if isinstance(jit_type, torch._C.OptionalType):
        jit_type = jit_type.getElementType()
    elif isinstance(jit_type, torch._C.ListType):
        jit_type = jit_type.getElementType()  # Tensor[] is cast; Tensor?[] is not
    return isinstance(jit_type, torch._C.TensorType)


def _overload(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    op: torch._ops.OpOverload = getattr(getattr(torch.ops.aten, packet), overload or "default")
    return op


def _cast_values(
    signature: _Signature, values: list[Any], dtype: torch.dtype, lower: torch.dtype
) -> list[Any]:
    cast: list[Any] = []
    for value, castable in zip(values, signature.castable, strict=True):
        if castable and isinstance(value, torch.Tensor):
            value = _cached_cast(value, dtype, lower)
        elif castable and isinstance(value, list | tuple):
            value = type(value)(_cached_cast(t, dtype, lower) for t in value)
        cast.append(value)
    return cast


def _promote_dtype(signature: _Signature, values: list[Any], lower: torch.dtype) -> torch.dtype:
    """torch's `promote_type`: fp32 if any eligible input is fp32, else the autocast dtype."""
    current = lower
    for value, castable in zip(values, signature.castable, strict=True):
        tensors = [value] if isinstance(value, torch.Tensor) else value
        if not castable or not isinstance(tensors, list | tuple):
            continue
        for tensor in tensors:
            if not tensor.is_floating_point() or tensor.device.type != "cpu":
                continue
            if tensor.dtype == torch.float64:
                continue  # torch ignores double inputs here
            if torch.float32 in (current, tensor.dtype):
                current = torch.float32
            elif tensor.dtype != lower:
                raise RuntimeError(
                    f"autocast: unexpected floating dtype {tensor.dtype} among the inputs of "
                    f"an op that promotes (autocast dtype {lower}), as CUDA would refuse it"
                )
    return current


Kernel = Callable[..., Any]


def _kernel(name: str, policy: CastPolicy) -> Kernel:
    op = _overload(name)
    signature = _Signature.of(op)

    if policy is CastPolicy.BANNED:

        def banned(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"{name} is unsafe to autocast and CUDA autocast refuses it; use "
                "binary_cross_entropy_with_logits (BCEWithLogitsLoss), which is safe"
            )

        return banned

    if policy is CastPolicy.FP32_SET_OPT_DTYPE:
        dtype_index = signature.names.index("dtype")
        log = _HALF_TO_FLOAT_LOG.get(name)  # None: not a softmax CUDA fuses

        def set_opt_dtype(*args: Any, **kwargs: Any) -> Any:
            values = signature.bind(args, kwargs)
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                # Only when the first input is eligible: an explicit output dtype would
                # interfere with the op's own promotion otherwise (torch's comment).
                if _is_eligible(values[0]) and values[dtype_index] is None:
                    values[dtype_index] = torch.float32
                first, dtype = values[0], values[dtype_index]
                if log is not None and first.dtype == torch.float16 and dtype == torch.float32:
                    return softmax_half_to_float(first, values[1], log)
                return signature.call(op, values)

        return set_opt_dtype

    if policy is CastPolicy.FP32_APPEND_DTYPE:
        target = _overload(APPEND_DTYPE_TARGETS[name])
        target_signature = _Signature.of(target)

        def append_dtype(*args: Any, **kwargs: Any) -> Any:
            values = signature.bind(args, kwargs)
            first = values[0]
            out_dtype = torch.float32 if _is_eligible(first) else first.dtype
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                return target_signature.call(target, [*values, out_dtype])

        return append_dtype

    def cast(*args: Any, **kwargs: Any) -> Any:
        lower = torch.get_autocast_dtype("cpu")
        values = signature.bind(args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if policy is CastPolicy.LOWER_PRECISION_FP:
                dtype = lower
            elif policy is CastPolicy.FP32:
                dtype = torch.float32
            else:
                dtype = _promote_dtype(signature, values, lower)
            return signature.call(op, _cast_values(signature, values, dtype, lower))

    return cast


@functools.cache
def _kernels() -> dict[str, Kernel]:
    return {name: _kernel(name, policy) for name, policy in CUDA_POLICY.items()}


def _read_cpu_listed_ops() -> frozenset[str]:
    listed = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(
            qualified, "AutocastCPU"
        ):
            listed.add(qualified.removeprefix("aten::"))
    return frozenset(listed)


# Read at import, before this module registers anything on AutocastCPU (a few milliseconds).
_CPU_LISTED_OPS = _read_cpu_listed_ops()


def cpu_listed_ops() -> frozenset[str]:
    """The aten ops torch's own CPU autocast casts ("op.overload"), read from the binary's
    `AutocastCPU` registrations."""
    return _CPU_LISTED_OPS


# ---------------------------------------------------------------------------------------------
# The context.


class _Registration:
    """The installed kernels and the wrapped cache-clearing function, undone by `remove`."""

    def __init__(self) -> None:
        fallthrough = sorted(_CPU_LISTED_OPS - CUDA_POLICY.keys())
        kernels = _kernels()
        # torch.library is untyped in torch 2.13, hence the no-untyped-call ignores.
        self._library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
        with warnings.catch_warnings():
            # torch warns once per process that a kernel overrides a registered one: the point.
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            for name, kernel in kernels.items():
                self._library.impl(name, kernel, "AutocastCPU")  # type: ignore[no-untyped-call]
            for name in fallthrough:
                self._library.impl(  # type: ignore[no-untyped-call]
                    name, torch.library.fallthrough_kernel, "AutocastCPU"
                )
        self._clear_autocast_cache = torch.clear_autocast_cache
        original = self._clear_autocast_cache

        def clear_autocast_cache() -> None:
            original()
            _CACHE.clear()

        torch.clear_autocast_cache = clear_autocast_cache

    def remove(self) -> None:
        torch.clear_autocast_cache = self._clear_autocast_cache
        self._library._destroy()  # type: ignore[no-untyped-call]
        _CACHE.clear()


_state_lock = threading.Lock()
_registration: _Registration | None = None
_depth = 0


@contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """A context in which `torch.autocast("cpu", dtype)` casts as `torch.autocast("cuda", dtype)`
    would, on CPU tensors. Outside it, CPU autocast is torch's own again. Re-entrant."""
    global _registration, _depth
    with _state_lock:
        if _depth == 0:
            _registration = _Registration()
        _depth += 1
    try:
        yield
    finally:
        with _state_lock:
            _depth -= 1
            if _depth == 0 and _registration is not None:
                _registration.remove()
                _registration = None


def is_cuda_policy_active() -> bool:
    """Whether `cuda_autocast_policy()` is in force (in any thread)."""
    return _depth > 0


__all__ = ["CUDA_POLICY", "CastPolicy", "cpu_listed_ops", "cuda_autocast_policy"]
