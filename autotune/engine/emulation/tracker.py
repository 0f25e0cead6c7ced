"""The live-byte tracker: counts the tensor-storage bytes a training step keeps alive, op by op.

`LiveBytesTracker` is a `TorchDispatchMode`. After every aten op it adds each output storage it has
not seen before (rounded up like the CUDA caching allocator) and a weakref callback subtracts it
when the storage dies. With a capacity it raises `torch.OutOfMemoryError` at the op that would
exceed it, which is what turns a CPU step into an emulated GPU (`autotune.engine.devices.device`).
Given the caching-allocator model (`autotune.core.memory.allocator`) it also mallocs every storage
there and frees it when the storage dies, and the capacity is then the allocator's: out-of-memory
comes when *reserved* memory would exceed it, as on a card. It labels every op with the training
phase (forward, backward, optimizer) and can record the live bytes after every op for the per-op
affine peak model.

What a live-byte count leaves out of a GPU's memory: docs/design.md#what-it-does-not-model.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from autotune.core.memory.allocator import (
    NO_BLOCK,
    AllocatorOutOfMemory,
    BlockId,
    CachingAllocator,
)
from autotune.core.memory.resident_placement import ResidentPlacement
from autotune.core.schemas import OOM_OP_MAX, OomDetail, Phase

logger = logging.getLogger(__name__)

_MiB = 2**20
# The CUDA caching allocator hands out multiples of 512 bytes (its kMinBlockSize), so a
# tracker that stands in for a GPU rounds the same way.
CUDA_BLOCK_BYTES = 512

# Read once: `_current_graph_task_id` is -1 outside the autograd engine, so it tells backward
# ops (including checkpoint recomputation) from forward ones at the cost of one C call per op.
_current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id

# Ops left uncounted, as if they were not there. record_function's enter/exit markers (the
# optimizer's step and zero_grad open one) allocate nothing and would mislabel the phase at the
# end of `step()`. A tensor's device query and the read of a scalar's value allocate nothing
# either, and fake tensors (the estimate) make the one and cannot make the other, so counting
# them would give an estimate other op series than the emulated GPU. Keyed by id because
# OpOverload.__hash__ is a Python function and this test runs on every op.
# A record_function's markers, which the layer journal keeps as boundaries.
MARKER_OP_IDS: frozenset[int] = frozenset(
    id(op)
    for op in (
        torch.ops.profiler._record_function_enter.default,
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    )
)
_UNCOUNTED_OP_IDS: frozenset[int] = MARKER_OP_IDS | frozenset(
    id(op) for op in (torch.ops.prim.device.default, torch.ops.aten._local_scalar_dense.default)
)
_DEVICE_QUERY = torch.ops.prim.device.default


def uncounted(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """An op the trackers pass through. A fake tensor's device query (the autograd engine makes
    one for most gradients it passes, two for every counted op of a traced step) is answered
    here as the fake-tensor mode below answers it (`torch._subclasses.fake_tensor`'s device
    handler), instead of by a second Python dispatch through that mode: about 30 us each."""
    if func is _DEVICE_QUERY and type(args[0]) is FakeTensor:
        tensor: Any = args[0]
        if not tensor.fake_mode.in_kernel_invocation:
            return tensor._fake_device  # what the `fake_device` property reads
    return func(*args, **(kwargs or {}))


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to one counted storage that remembers its key, its counted bytes and
    its block in the allocator model (`NO_BLOCK` without one)."""

    __slots__ = ("key", "counted_bytes", "block", "event")

    key: int
    counted_bytes: int
    block: BlockId
    event: int  # its allocation's position in `allocations` (-1: not recorded)


# TorchDispatchMode's own methods carry no annotations, hence the no-untyped-call ignores.
class LiveBytesTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts live tensor-storage bytes and their peak while a step runs under `with tracker:`.

    Args:
        capacity_bytes: raise `torch.OutOfMemoryError` when live bytes would exceed this;
            None only measures (or leaves the limit to `allocator`).
        allocator: the caching allocator the storages live in: each new storage is malloc'd
            from it and freed when it dies, and its out-of-memory (reserved memory past its
            capacity, after freeing its cache and retrying) is raised as `torch.OutOfMemoryError`.
        block_bytes: every storage is counted rounded up to a multiple of this (512 like the
            CUDA caching allocator; 1 counts exact bytes).
        record_series: keep the live bytes after every op in `series`, and every allocation
            and free in `allocations` (encoded as `autotune.core.memory.allocation_trace` reads it:
            a size for a storage allocated, -(n + 1) for the free of allocation event n).

    With `holders` set, an out-of-memory also leaves `oom`: the allocation that failed, its op
    and phase, and the live bytes of the holders' weights, gradients and optimizer state, the
    rest allocated and the allocator's cache at that moment.

    Storages that exist before the step (parameters, gradients, optimizer state, buffers,
    inputs) are invisible to a dispatch mode until an op returns them, so count them first
    with `add_resident`. A storage is counted once however many tensors view it, and stops
    counting when Python frees it. Use a new tracker per step: the peaks are never reset.
    """

    def __init__(
        self,
        capacity_bytes: int | None,
        *,
        allocator: CachingAllocator | None = None,
        block_bytes: int = CUDA_BLOCK_BYTES,
        record_series: bool = False,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.allocator = allocator
        self.block_bytes = block_bytes
        self.record_series = record_series
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase = Phase.FORWARD
        self.phase_peak_bytes: dict[Phase, int] = {}
        self.series: list[int] = []
        self.allocations: list[int] = []
        self._active = False
        self.op_count = 0
        # id(storage) -> its weakref. The id is stable while the storage lives because torch
        # preserves a storage's Python object as long as the C++ storage exists, and the
        # weakref callback removes the entry before the id can be reused.
        self._storages: dict[int, _StorageRef] = {}
        # sys.maxsize rather than None keeps the per-op capacity check a single comparison.
        self._limit_bytes = sys.maxsize if capacity_bytes is None else capacity_bytes
        self._in_optimizer = False
        self._hooks: list[RemovableHandle] = []
        self._original_storage_resize: Any = None
        self.holders: Callable[[], MemoryHolders] | None = None
        self.oom: OomDetail | None = None
        self._op: object = "the step's resident tensors"
        # The blocks `add_resident` hands the residents it places, in the order it counts them.
        self._placed: list[BlockId] = []
        # How many of `allocations` are the residents' (the first ones).
        self.resident_events = 0
        # Tensors first counted just before the first op of `deferred_ops` on a thread (True:
        # the autograd engine's, running backward; False: the caller's): the BLAS workspaces
        # a card allocates as a thread's first matmul creates its cuBLAS handle.
        self.deferred: dict[bool, list[torch.Tensor]] = {}
        self.deferred_ops: frozenset[str] = frozenset()

    # -------------------------------------------------------------------------------------
    # Counting storages.

    def add_resident(
        self, tensors: Iterable[torch.Tensor], placement: ResidentPlacement | None = None
    ) -> None:
        """Count storages that already exist, and a tensor's `.grad` with it; dedupes by storage.
        With `placement` (and the allocator), the allocator starts in the state the warm-up
        left and each resident takes its block there (`ResidentPlacement.place`); without, they
        are malloc'd in order.

        No capacity check here: what is resident before the step is the caller's business, and
        the first op of the step raises if it already does not fit.
        """
        counted = [t for tensor in tensors for t in (tensor, tensor.grad) if t is not None]
        if placement is not None and self.allocator is not None:
            new: dict[int, int] = {}
            for tensor in counted:
                try:
                    storage = local_tensor(tensor).untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                if id(storage) not in self._storages:
                    new.setdefault(id(storage), storage.nbytes())
            try:
                self._placed = placement.place(self.allocator, list(new.values()))
            except AllocatorOutOfMemory as error:
                raise self._out_of_memory(error) from None
            self._placed.reverse()
        for tensor in counted:
            self._count(tensor)
        self._placed = []
        self.resident_events = len(self.allocations)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def _rounded(self, nbytes: int) -> int:
        block = self.block_bytes
        return -(-nbytes // block) * block

    def _count(self, tensor: torch.Tensor) -> int:
        """Count `tensor`'s storage if new (or its growth if resized); return the bytes added."""
        try:
            storage = local_tensor(tensor).untyped_storage()
        except (RuntimeError, NotImplementedError):
            # Sparse and other storage-less layouts: nothing a dense allocator would hold.
            return 0
        key = id(storage)
        ref = self._storages.get(key)
        if ref is None:
            # Malloc first: a storage the allocator refuses is never counted, and the op's
            # outputs are released (and their blocks freed) as the exception unwinds.
            block = self._malloc(storage.nbytes())
            ref = _StorageRef(storage, self._release)
            ref.key = key
            ref.counted_bytes = self._rounded(storage.nbytes())
            ref.block = block
            ref.event = self._record_allocation(storage.nbytes())
            self._storages[key] = ref
            self.live_bytes += ref.counted_bytes
            return ref.counted_bytes
        # A known storage can only change size in place (resize_, set_, out= ops).
        return self._resized(ref, storage.nbytes())

    def _resized(self, ref: _StorageRef, nbytes: int) -> int:
        """Account a known storage's new size; return the bytes it grew by (0 if it shrank)."""
        counted_bytes = self._rounded(nbytes)
        grown_bytes = counted_bytes - ref.counted_bytes
        if grown_bytes and self.allocator is not None:
            # A resized storage is a new allocation the data is copied into, then the old one is
            # freed, growing or shrinking (ATen's `resize_bytes_cuda`);
            # a resize to 0 (how FSDP frees a parameter) mallocs nothing.
            block = self._malloc(nbytes)
            self.allocator.free(ref.block)
            ref.block = block
        if grown_bytes:
            event = self._record_allocation(nbytes)
            self._record_free(ref)
            ref.event = event
        if grown_bytes:
            ref.counted_bytes = counted_bytes
            self.live_bytes += grown_bytes
        return max(grown_bytes, 0)

    def _malloc(self, nbytes: int) -> BlockId:
        if self.allocator is None:
            return NO_BLOCK
        if self._placed:
            return self._placed.pop()  # a resident's block, placed already
        try:
            return self.allocator.malloc(nbytes)
        except AllocatorOutOfMemory as error:
            raise self._out_of_memory(error) from None

    def _out_of_memory(self, error: AllocatorOutOfMemory) -> torch.OutOfMemoryError:
        self._record_oom(
            error.allocation_bytes,
            allocated_bytes=error.allocated_bytes,
            cache_bytes=error.reserved_bytes - error.allocated_bytes,
        )
        return torch.OutOfMemoryError(_out_of_memory_message(error, self.phase))

    def _record_oom(
        self, allocation_bytes: int, *, allocated_bytes: int, cache_bytes: int
    ) -> None:
        """`oom`, while every storage of the step is still alive (the exception frees them)."""
        if self.holders is None:
            return
        holders = self.holders()
        weights = self._live_bytes_of(holders.weights)
        gradients = self._live_bytes_of(holders.gradients)
        optimizer_state = self._live_bytes_of(holders.optimizer_state)
        self.oom = OomDetail(
            allocation_bytes=allocation_bytes,
            phase=self.phase,
            op=str(self._op)[:OOM_OP_MAX],
            weights_bytes=weights,
            gradients_bytes=gradients,
            optimizer_state_bytes=optimizer_state,
            activations_bytes=max(0, allocated_bytes - weights - gradients - optimizer_state),
            cache_bytes=max(0, cache_bytes),
        )

    def _live_bytes_of(self, tensors: Iterable[torch.Tensor]) -> int:
        """The counted bytes of the live storages of `tensors`, each storage once."""
        seen: set[int] = set()
        total = 0
        for tensor in tensors:
            try:
                key = id(local_tensor(tensor).untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
            ref = self._storages.get(key)
            if ref is not None and key not in seen:
                seen.add(key)
                total += ref.counted_bytes
        return total

    def _release(self, ref: weakref.ref[Any]) -> None:
        # Runs when a counted storage is freed, whenever that is (mid-op, after the step, in gc).
        assert isinstance(ref, _StorageRef)
        if self._storages.pop(ref.key, None) is ref:
            self.live_bytes -= ref.counted_bytes
            if self.allocator is not None:
                self.allocator.free(ref.block)
            self._record_free(ref)

    def _record_allocation(self, nbytes: int) -> int:
        if not self.record_series:
            return -1
        self.allocations.append(nbytes)
        return len(self.allocations) - 1

    def _record_free(self, ref: _StorageRef) -> None:
        # Only frees of recorded allocations, and only while the tracker is active: storages of
        # the step that die after it (its outputs, in the caller's hands) are not the step's.
        if ref.event >= 0 and self._active:
            self.allocations.append(-(ref.event + 1))

    def _count_deferred(self, backward: bool) -> None:
        """Count the tensors deferred to this thread's first such op (`deferred`)."""
        for tensor in self.deferred.pop(backward, []):
            self._count(tensor)

    def _count_outputs(self, out: object) -> int:
        if isinstance(out, torch.Tensor):
            return self._count(out)
        if isinstance(out, (tuple, list)):
            # Multi-output ops return tuples; foreach and fused optimizer ops return lists.
            return sum(self._count_outputs(item) for item in out)
        return 0

    # -------------------------------------------------------------------------------------
    # The per-op hook: keep it short, it runs for every op of every trial.

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps each mode's own __torch_dispatch__ in a guard that keeps torch.compile
        # out of it: four eval-frame switches a call, and a trace on fake tensors makes about
        # three calls per op here (device queries pass through every mode too). No step runs
        # compiled, so the trackers opt out of the guard (docs/design.md#the-layer-replay).
        return False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if id(func) in _UNCOUNTED_OP_IDS:
            return uncounted(func, args, kwargs)
        # The phase is decided before the op runs so that a real allocator failure inside the
        # op is reported in the phase of the op that failed.
        if self._in_optimizer:
            phase = Phase.OPTIMIZER
        elif _current_graph_task_id() != -1:
            phase = Phase.BACKWARD
        else:
            phase = Phase.FORWARD
        phase_changed = phase is not self.phase
        self.phase = phase
        self._op = func
        if self.deferred and func.overloadpacket.__name__ in self.deferred_ops:
            self._count_deferred(phase is Phase.BACKWARD)
        live_before_bytes = self.live_bytes
        out = func(*args, **(kwargs or {}))
        added_bytes = self._count_outputs(out)
        self.op_count += 1
        live_bytes = self.live_bytes
        if added_bytes and live_bytes > self._limit_bytes:
            # The peak stays at what ran before this allocation; the outputs are already
            # counted, and are subtracted when the exception releases them.
            self._record_oom(added_bytes, allocated_bytes=live_before_bytes, cache_bytes=0)
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (emulated). Tried to allocate {added_bytes / _MiB:.2f} MiB "
                f"in {func}; capacity {self._limit_bytes / _MiB:.2f} MiB, "
                f"{live_before_bytes / _MiB:.2f} MiB live, phase {phase.value}"
            )
        if added_bytes or phase_changed:
            if live_bytes > self.peak_bytes:
                self.peak_bytes = live_bytes
            if live_bytes > self.phase_peak_bytes.get(phase, -1):
                self.phase_peak_bytes[phase] = live_bytes
        if self.record_series:
            self.series.append(live_bytes)
        return out

    # -------------------------------------------------------------------------------------
    # Phases and storage resizes come from hooks installed only while the tracker is active.

    def _enter_optimizer(self, *_: object) -> None:
        self._in_optimizer = True

    def _leave_optimizer(self, *_: object) -> None:
        self._in_optimizer = False

    def __enter__(self) -> LiveBytesTracker:
        self._in_optimizer = False
        self._hooks = [
            register_optimizer_step_pre_hook(self._enter_optimizer),
            register_optimizer_step_post_hook(self._leave_optimizer),
        ]
        self._patch_storage_resize()
        self._active = True
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc_value, traceback)  # type: ignore[no-untyped-call]
        self._active = False
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._restore_storage_resize()
        # `phase` is left as it was: after an out-of-memory it names the phase that failed.
        self._in_optimizer = False

    def _patch_storage_resize(self) -> None:
        # UntypedStorage.resize_ bypasses the dispatcher (FSDP frees parameters this way), so it
        # is wrapped for the tracker's lifetime, as MemTracker does.
        original = torch.UntypedStorage.resize_
        self._original_storage_resize = original
        tracker = self

        def resize_(storage: Any, size: int) -> Any:
            tracker._op = "UntypedStorage.resize_"
            result = original(storage, size)
            ref = tracker._storages.get(id(storage))
            if ref is not None:
                tracker._resized(ref, storage.nbytes())
                tracker.peak_bytes = max(tracker.peak_bytes, tracker.live_bytes)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]

    def _restore_storage_resize(self) -> None:
        if self._original_storage_resize is not None:
            torch.UntypedStorage.resize_ = self._original_storage_resize  # type: ignore[method-assign]
            self._original_storage_resize = None


@dataclass(frozen=True)
class MemoryHolders:
    """What a training step holds besides its activations, named for an out-of-memory's
    detail: the model's parameters and buffers, their gradients, the optimizer's state."""

    weights: list[torch.Tensor]
    gradients: list[torch.Tensor]
    optimizer_state: list[torch.Tensor]


def _out_of_memory_message(error: AllocatorOutOfMemory, phase: Phase) -> str:
    # The figures torch's message gives (the CUDA caching allocator's malloc).
    unallocated_bytes = error.reserved_bytes - error.allocated_bytes
    return (
        f"CUDA out of memory (emulated). Tried to allocate {error.allocation_bytes / _MiB:.2f} "
        f"MiB; capacity {error.capacity_bytes / _MiB:.2f} MiB, of which "
        f"{error.allocated_bytes / _MiB:.2f} MiB is allocated by PyTorch and "
        f"{unallocated_bytes / _MiB:.2f} MiB is reserved by PyTorch but unallocated; "
        f"phase {phase.value}"
    )


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What a device holds of `tensor`: a DTensor's (sharded parameters, their gradients and
    optimizer states) local shard, any other tensor itself. A DTensor's own storage is its
    global size."""
    local = getattr(tensor, "_local_tensor", None)  # torch.distributed.tensor.DTensor
    return local if isinstance(local, torch.Tensor) else tensor


def resident_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> list[torch.Tensor]:
    """Everything a training step finds already allocated: parameters, buffers, gradients (via
    `add_resident`) and the optimizer's state tensors."""
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors
