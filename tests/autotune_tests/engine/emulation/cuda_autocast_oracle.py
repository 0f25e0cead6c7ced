"""torch's own CUDA autocast, run on this CPU-only build, as the reference for the emulated GPU.

The 2.13 CPU wheel registers CUDA's autocast kernels too (the `AutocastCUDA` dispatch key), and
`FakeTensorMode` can make tensors that claim to live on a CUDA device. Run under
`torch.set_autocast_enabled("cuda", True)`, a function on such tensors goes through torch's
compiled CUDA casts, then through meta kernels: what the GPU would run, in which dtypes, without
a GPU. Forward only: autograd on fake CUDA tensors aborts the process (it needs the CUDA device
guard), and so do a few Python-level tensor methods (slicing, some `contiguous` calls), so the
functions given here avoid them.

`trace_on_fake_cuda` and `trace_on_emulated_gpu` record every aten op that runs below autocast,
with the dtypes of its tensor inputs and outputs; equal traces mean the same casts, the same
kernels and the same dtypes everywhere, so autograd (whose formulas do not depend on the device)
saves tensors of the same dtypes.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autotune.engine.emulation.autocast import cuda_autocast_policy

OpRecord = tuple[str, tuple[str, ...], tuple[str, ...]]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtypes(tree: Any) -> tuple[str, ...]:
    leaves, _ = tree_flatten(tree)
    return tuple(dtype_name(t.dtype) for t in leaves if isinstance(t, torch.Tensor))


class OpTrace(TorchDispatchMode):  # type: ignore[misc]
    """Every aten op dispatched below autograd and autocast: (name, input dtypes, outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if name == "autotune::softmax_half_to_float":
            # The emulated GPU's stand-in for CUDA's fused fp16 -> fp32 (log_)softmax kernel.
            name = "aten::_log_softmax" if args[2] else "aten::_softmax"
        # lift_fresh only marks a constant tensor made inside fake mode: not an op of the model.
        if name.startswith("aten::") and name != "aten::lift_fresh":
            self.ops.append((name, _dtypes((args[:2], kwargs)), _dtypes(out)))
        return out


@contextlib.contextmanager
def _cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    # torch.autocast("cuda") disables itself without a GPU; the switches underneath do not.
    previous_dtype = torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", previous_dtype)


def trace_on_fake_cuda(
    fn: Callable[..., Any], tensors: Sequence[torch.Tensor], dtype: torch.dtype
) -> list[OpRecord]:
    """`fn(*tensors)` under torch's CUDA autocast, on fake CUDA copies of `tensors` (no grad;
    attention on the math path, which both sides can run)."""
    mode = FakeTensorMode()
    fakes = [FakeTensor(mode, t.detach().to("meta"), torch.device("cuda")) for t in tensors]
    trace = OpTrace()
    with mode, torch.no_grad(), sdpa_kernel(SDPBackend.MATH), _cuda_autocast(dtype), trace:
        fn(*fakes)
    return trace.ops


def trace_on_emulated_gpu(
    fn: Callable[..., Any],
    tensors: Sequence[torch.Tensor],
    dtype: torch.dtype,
    *,
    policy: bool = True,
) -> list[OpRecord]:
    """`fn(*tensors)` under CPU autocast, with CUDA's policy (or, `policy=False`, the CPU's)."""
    context = cuda_autocast_policy() if policy else contextlib.nullcontext()
    trace = OpTrace()
    detached = [t.detach() for t in tensors]
    with context, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        with torch.autocast("cpu", dtype=dtype), trace:
            fn(*detached)
    return trace.ops


def saved_dtypes(
    fn: Callable[..., Any], tensors: Sequence[torch.Tensor], dtype: torch.dtype
) -> Counter[str]:
    """The dtypes of the tensors autograd saves for backward while `fn(*tensors)` runs on the
    emulated GPU (floating inputs become leaves that require grad)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    saved: Counter[str] = Counter()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[dtype_name(tensor.dtype)] += 1
        return tensor

    with cuda_autocast_policy(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        with torch.autocast("cpu", dtype=dtype):
            fn(*leaves)
    return saved


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def saved_by_node(root: Any) -> Counter[tuple[str, str, str]]:
    """(autograd node, saved field, dtype) for every tensor the graph under `root` saves."""
    seen: set[Any] = set()
    stack = [root]
    saved: Counter[tuple[str, str, str]] = Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        fields = [a for a in dir(node) if a.startswith("_saved_")]
        values = [(f.removeprefix("_saved_"), getattr(node, f)) for f in fields]
        if not fields and hasattr(node, "saved_tensors"):  # a custom autograd.Function
            values = [("saved_tensors", node.saved_tensors)]
        for field, value in values:
            for tensor in value if isinstance(value, tuple | list) else [value]:
                if isinstance(tensor, torch.Tensor):
                    saved[(node.name(), field, dtype_name(tensor.dtype))] += 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    return saved


@functools.cache
def ops_registered_for(dispatch_key: str) -> frozenset[str]:
    """aten ops ("op.overload") with a kernel for `dispatch_key` in this binary."""
    return frozenset(
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key)
    )
