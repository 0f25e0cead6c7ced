"""The layer replay's speed pass: a deep decoder's roofline step time from a shallow one's.

A decoder's layers run the same kernels on the same shapes, so a kernel inside a layer takes
the same roofline time in every layer: the deep model's step is the shallow one's with the
middle layers' kernels counted once per middle layer (docs/design.md#the-layer-replay). Only
the kernels that span layers do not add up that way: the optimizer's foreach kernels (or its
fused kernel) read every layer's parameters, gradients and state in one launch, most of them
writing some in place (`autotune.engine.kernel_times.written_arguments`), and a roofline
time is the longer of arithmetic and traffic plus one launch, not a sum over layers. For those,
`LayerKernelTimes` keeps the bytes each layer's tensors contribute and times the kernel once
with the deep model's bytes: what the deep model's own launch moves. On a ZeRO-1 rank the local
optimizer's foreach kernels read the rank's partition of the parameters, which no layer's bytes
give: they are timed with the deep rank's partition's (`autotune.engine.replay.layer_zero1`).

Which layer a kernel belongs to is the journal's rule (`autotune.engine.emulation.layer_journal`):
the layer whose forward or backward runs (`LayerContexts`), else the layer of the tensors it
reads, tagged from the parameters, their gradients and optimizer state on, a foreach kernel's
i-th tensors being the i-th parameter's. Which traced layer each deep layer repeats is the
replay's plan (`autotune.engine.replay.layer_plan`): under partial checkpointing a checkpointed
and a
plain middle layer, each counted for its own kind's layers.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from autotune.core.gpus.cuda_reserve import GpuBudget
from autotune.core.gpus.roofline import RooflineAssumptions
from autotune.core.schemas import Phase
from autotune.engine.emulation.layer_journal import (
    FIXED,
    NO_LAYER,
    STICKY,
    LayerContexts,
    NotReplayable,
    ViewKey,
    gradient_view,
    output_tags,
    storage_key,
    tag_of,
)
from autotune.engine.emulation.tracker import _current_graph_task_id, local_tensor
from autotune.engine.kernel_times import Kernel, KernelTimes, is_multi_tensor, written_arguments
from autotune.engine.replay.layer_plan import LayerPlan
from autotune.engine.replay.layer_zero1 import PartitionBytes

# A kernel that spans layers: (micro-step, its kernel, bytes of no layer's tensors, bytes of
# each layer's).
_Spanning = tuple[int, Kernel, int, list[int]]


class LayerKernelTimes(KernelTimes):  # type: ignore[no-untyped-call]
    """`KernelTimes` over a shallow model of `depth` layers (`contexts` on its layers), filing
    each kernel under the layer it belongs to (module docstring); `deep_times_s` times the deep
    model's step from them. `tags` maps the storages of the parameters, gradients and
    optimizer state to their layer (FIXED: none's) and is extended as the step makes tensors
    of one layer outside the layers; `record_gradient` tags a gradient once complete. On a
    ZeRO-1 rank, `partition` gives the deep rank's bytes of its optimizer's foreach kernels.

    They hold no tensor of the step: a storage tagged here loses its tag as it dies, before a
    new storage can take its id, and a kernel spanning layers is kept as its arithmetic. So
    they change nothing a tracker counts, and can time the step a trial traces
    (`autotune.engine.replay.layer_replay`)."""

    def __init__(
        self,
        budget: GpuBudget,
        assumptions: RooflineAssumptions,
        tf32: bool,
        *,
        contexts: LayerContexts,
        tags: dict[int, int],
        depth: int,
        partition: PartitionBytes | None = None,
    ) -> None:
        super().__init__(budget, assumptions, tf32)
        self.contexts = contexts
        self.tags = tags
        # Gradients that are views of DDP's buckets, by view (`gradient_view`).
        self.views: dict[ViewKey, int] = {}
        self.depth = depth
        contexts.reset()
        self._micro_step = 0
        self._in_backward = False
        self._sticky: int | None = None
        # Per micro-step (the optimizer's kernels after the last one's end): the time of the
        # kernels of no layer, and of each layer's.
        self._fixed_s: list[float] = [0.0]
        self._layer_s: list[list[float]] = [[0.0] * depth]
        self._spanning: list[_Spanning] = []
        self.partition = partition
        # ZeRO-1's foreach kernels over the rank's partition: (micro-step, kernel, the deep
        # rank's bytes).
        self._partitioned: list[tuple[int, Kernel, int]] = []
        # What each layer launched, in order, to check that the middle layers are one layer.
        self._launched: list[list[tuple[Any, ...]]] = [[] for _ in range(depth)]
        # The storages tagged here, by key: a key is a storage's id, which a new storage could
        # take once the old one is freed, and inherit its tag; each tag goes as its storage
        # dies (`_forget`).
        self._watched: dict[int, weakref.ref[Any]] = {}

    def end_micro_step(self) -> None:
        super().end_micro_step()
        self._micro_step += 1
        self._fixed_s.append(0.0)
        self._layer_s.append([0.0] * self.depth)

    def record_gradient(self, parameter: torch.Tensor, tag: int, number: int = -1) -> None:
        """`parameter.grad` is complete: its storage (or its view of a bucket) is `tag`'s
        layer's gradient."""
        del number  # the journal's, for DDP's buckets; a kernel names no parameter
        grad = parameter.grad
        key = storage_key(grad) if grad is not None else None
        if grad is not None and key is not None:
            view = gradient_view(grad)
            if view is None:
                self.tags[key] = tag
            else:
                self.views[view] = tag
            self._watch(key, grad)

    def _watch(self, key: int, tensor: torch.Tensor) -> None:
        """Forget what is tagged of `tensor`'s storage (key `key`) once it dies."""
        if key not in self._watched:
            storage = local_tensor(tensor).untyped_storage()
            self._watched[key] = weakref.ref(storage, functools.partial(self._forget, key))

    def _forget(self, key: int, ref: weakref.ref[Any]) -> None:
        # Runs as the storage dies: its id is free for a new storage, which has no tag.
        if self._watched.get(key) is ref:
            del self._watched[key]
            self.tags.pop(key, None)
            for view in [view for view in self.views if view[0] == key]:
                del self.views[view]

    def _context(self) -> int:
        backward = _current_graph_task_id() != -1
        if backward and not self._in_backward:
            self.contexts.backward_layer = NO_LAYER  # a backward pass starts outside the layers
        self._in_backward = backward
        return self.contexts.current(Phase.BACKWARD if backward else Phase.FORWARD)

    def record(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: object
    ) -> None:
        kernel = self.kernel(func, args, kwargs, out)
        context = self._context()
        if context != NO_LAYER:
            if kernel is not None:
                self._file(context, func, kernel)
            return
        # Outside the layers: the outputs take the layer of what the op reads.
        per_output, tag = output_tags(func, args, kwargs, self.tags, self.views)
        outputs = pytree.tree_leaves(out)
        if isinstance(per_output, list) and isinstance(out, (list, tuple)):
            pairs = list(zip(out, per_output, strict=False))
        else:
            single = per_output if isinstance(per_output, int) else STICKY
            pairs = [(item, single) for item in outputs]
        for item, item_tag in pairs:
            if not isinstance(item, torch.Tensor) or item_tag == STICKY:
                continue
            key = storage_key(item)
            if key is not None and key not in self.tags:
                self.tags[key] = item_tag
                self._watch(key, item)
        owner = tag if tag >= 0 else (None if tag == FIXED else self._sticky)
        self._sticky = owner
        if kernel is None:
            return
        if self.partition is not None and is_multi_tensor(func):
            written = written_arguments(func, args, kwargs)
            deep_bytes = self.partition.deep_bytes(args, kwargs, [out, *written])
            if deep_bytes is not None and kernel.flops == 0:
                # Kept as its arithmetic, as a spanning kernel is: its tensors are the step's.
                arithmetic = Kernel(kernel.flops, [], [], kernel.dtype)
                self._partitioned.append((self._micro_step, arithmetic, deep_bytes))
                return
        layer_bytes = [0] * self.depth
        fixed_bytes = 0
        for tensor in (*kernel.inputs, *kernel.outputs):
            tagged = tag_of(tensor, self.tags, self.views)
            layer = FIXED if tagged is None else tagged
            nbytes = tensor.numel() * tensor.element_size()
            if layer >= 0:
                layer_bytes[layer] += nbytes
            else:
                fixed_bytes += nbytes
        layers = [layer for layer, nbytes in enumerate(layer_bytes) if nbytes]
        if not layers:
            if owner is None:
                self._fixed_s[-1] += self.kernel_time_s(kernel)
            else:  # it goes with the layer's kernels before it (AdamW's step counters)
                self._file(owner, func, kernel)
            return
        if len(layers) == 1:
            # One layer's kernel: a per-parameter op, or a foreach kernel over one layer's
            # tensors (FSDP2's cast of a unit's shards before its gather, when the root's
            # backward prefetches the last layer outside the layers).
            self._file(layers[0], func, kernel)
            return
        if is_multi_tensor(func) and kernel.flops == 0:
            # One launch over every layer's tensors: timed once, with the deep model's bytes
            # (kept without its tensors, which are the step's).
            arithmetic = Kernel(kernel.flops, [], [], kernel.dtype)
            self._spanning.append((self._micro_step, arithmetic, fixed_bytes, layer_bytes))
            return
        raise NotReplayable(f"{func} reads tensors of layers {layers}")

    def _file(self, layer: int, func: Any, kernel: Kernel) -> None:
        self._layer_s[-1][layer] += self.kernel_time_s(kernel)
        self._launched[layer].append((func, kernel.flops, kernel.bytes_moved, kernel.dtype))

    def deep_times_s(self, plan: LayerPlan) -> list[float]:
        """The deep model's time of each micro-step (its forward and backward; the first's
        includes making the step's batches) and, last, of the optimizer's step, for
        `plan.depth` layers: each traced layer's kernels once for each deep layer that repeats
        it (`LayerPlan.weights`: layers 0, 1, d-2 and d-1 once and the pure middle layer 2 for
        each of the N - 4 layers between, when all layers are of one kind).

        Raises:
            NotReplayable: the layers of a repeated run launched different kernels, or a kernel
                spanning layers read different bytes of them.
        """
        if plan.traced_layers != self.depth:
            raise NotReplayable(f"a plan of {plan.traced_layers} layers for {self.depth}")
        for run in plan.repeated:
            pure = plan.pure(run)
            if any(self._launched[layer] != self._launched[pure] for layer in run):
                raise NotReplayable("the middle layers launched different kernels")
        # The deep model's layers take the traced layers as `expand`'s templates
        # (`autotune.engine.replay.layer_replay`).
        weights = plan.weights()
        times = [
            fixed + sum(weight * s for weight, s in zip(weights, layer_s, strict=True))
            for fixed, layer_s in zip(self._fixed_s, self._layer_s, strict=True)
        ]
        for micro_step, kernel, fixed_bytes, layer_bytes in self._spanning:
            uneven = any(
                layer_bytes[layer] != layer_bytes[plan.pure(run)]
                for run in plan.repeated
                for layer in run
            )
            if uneven or not all(layer_bytes):
                raise NotReplayable("a kernel spans the layers unevenly")
            deep_bytes = fixed_bytes + sum(
                weight * nbytes for weight, nbytes in zip(weights, layer_bytes, strict=True)
            )
            times[micro_step] += self.kernel_time_s(kernel, deep_bytes)
        if self._partitioned and (self.partition is None or self.partition.depth != plan.depth):
            raise NotReplayable(f"a ZeRO-1 partition of other than {plan.depth} layers")
        for micro_step, kernel, deep_bytes in self._partitioned:
            times[micro_step] += self.kernel_time_s(kernel, deep_bytes)
        return times


def step_times_s(times: Sequence[float]) -> tuple[float, float]:
    """A step's total time and that of its middle micro-step (0 with fewer than three) from
    `LayerKernelTimes.deep_times_s`."""
    middle_s = times[1] if len(times) > 3 else 0.0
    return sum(times), middle_s


__all__ = ["LayerKernelTimes", "step_times_s"]
