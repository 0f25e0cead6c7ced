"""A traced step's journal: every allocation, free and op of the live-byte tracker, in order,
with the decoder layer each belongs to. It is what the estimate's layer replay reads to build a
deep model's step from a shallow one's (`autotune.engine.replay.layer_replay`).

Which layer an event belongs to:

* inside a layer's forward (a recomputation under checkpointing included), that layer: module
  hooks keep a stack of the layers being run;
* in the backward pass, the layer whose backward runs: a hook on each layer's output fires when
  the gradient of that output is complete, which is when the autograd engine starts on the
  layer's own nodes (it runs nodes in the reverse order of their creation, so the later layer's
  nodes all run first);
* outside both (the resident tensors, the optimizer's step, the gradients' release), the layer
  whose tensors the op reads: a parameter's storage, its gradient and its optimizer state carry
  its layer's tag, a foreach op's i-th output the tag of its first list's i-th tensor, any other
  op's outputs the one tag its inputs share. An op that reads no tagged tensor is `STICKY`: it
  goes with whatever precedes it (AdamW's step counters, made one per parameter beside its
  moments).

What an out-of-memory's detail counts as weights and gradients is what is registered on the model
at that moment (`autotune.engine.emulation.tracker.MemoryHolders`): on an FSDP2 rank a block's
gathered parameters while it runs, its shards otherwise, each with its own `.grad`. The journal
records each swap (FSDP2's `FSDPParam._setattr_on_modules`, watched while the tracker is active)
as the storages it drops and holds, and each gradient a registered gathered parameter receives,
so that the detail can be computed from the journal alone (docs/design.md#the-layer-replay).

The hooks and the journal allocate nothing and change no op: the journal is a record of the
step the plain tracker would count.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree
from torch import nn

from autotune.core.memory.resident_placement import ResidentPlacement
from autotune.core.schemas import Phase
from autotune.engine.emulation.tracker import (
    _UNCOUNTED_OP_IDS,
    MARKER_OP_IDS,
    LiveBytesTracker,
    _current_graph_task_id,
    _StorageRef,
    local_tensor,
    uncounted,
)

# FSDP2's parameter, whose `_setattr_on_modules` registers its sharded or gathered tensor on its
# module; looked up only once FSDP2 is imported (a rank that is not sharded never imports it).
_FSDP_PARAM_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param"

# Journal records, tuples for speed (a small trace writes some ten thousand):
#   (ALLOC, nbytes, context, tag, phase, category)
#   (FREE, journal index of the allocation, context)
#   (OP, context, tag, phase, peak_check, op)
#   (GRAD, journal index of the allocation, context, parameter)  -- that storage became the
#       .grad of the parameter of that number (the trainable parameters' order, -1: unknown)
#   (MARK, context)  -- an uncounted op (a record_function's marker): a boundary, nothing else
#   (HOLD, journal index of the allocation, context)  -- that storage became a registered
#       parameter's (FSDP2 registered a block's gathered or sharded parameters on its modules)
#   (DROP, journal index of the allocation, context)  -- it stopped being one
#   (UNGRAD, journal index of the allocation, context)  -- it stopped being a registered
#       parameter's .grad (its parameter was swapped out)
ALLOC, FREE, OP, GRAD, MARK, HOLD, DROP, UNGRAD = 0, 1, 2, 3, 4, 5, 6, 7
# The records that name an allocation (their second field), renumbered when a journal is written
# out for another depth.
REFERENCES = (FREE, GRAD, HOLD, DROP, UNGRAD)
NO_LAYER = -1  # a context outside every layer
FIXED = -1  # a tag: no layer's, or several layers'
STICKY = -2  # a tag: no tagged input; the event goes with the one before it
# Categories of an allocation, for an out-of-memory's detail (`autotune.core.schemas.OomDetail`),
# and DDP's gradient buckets, which the replay lays out for the deep model
# (`autotune.engine.replay.layer_buckets`); a bucket is no weight nor state.
OTHER, WEIGHT, OPTIMIZER_STATE, BUCKET = 0, 1, 2, 3


class NotReplayable(Exception):
    """The shallow trace does not show the layer structure the layer replay relies on."""


def storage_key(tensor: torch.Tensor) -> int | None:
    """The tracker's key of `tensor`'s storage (None without one)."""
    try:
        return id(local_tensor(tensor).untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _or_sticky(tag: int | None) -> int:
    return STICKY if tag is None else tag


# A view of a shared storage: (the storage's key, offset, elements).
ViewKey = tuple[int, int, int]


def gradient_view(grad: torch.Tensor) -> ViewKey | None:
    """A gradient that is a view into a larger storage (DDP's buckets, whose gradients are
    their views: `gradient_as_bucket_view`) is tagged as that view, not as the storage, which
    holds gradients of several layers; None for a gradient with a storage of its own."""
    key = storage_key(grad)
    if key is None:
        return None
    local = local_tensor(grad)
    if local.untyped_storage().nbytes() == local.numel() * local.element_size():
        return None
    return (key, int(local.storage_offset()), local.numel())


def tag_of(
    tensor: torch.Tensor, tags: dict[int, int], views: dict[ViewKey, int] | None = None
) -> int | None:
    """`tensor`'s tag: its view's (`gradient_view`) in `views`, else its storage's in `tags`
    (None: untagged)."""
    key = storage_key(tensor)
    if key is None:
        return None
    if views:
        local = local_tensor(tensor)
        tag = views.get((key, int(local.storage_offset()), local.numel()))
        if tag is not None:
            return tag
    return tags.get(key)


def output_tags(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tags: dict[int, int],
    views: dict[ViewKey, int] | None = None,
) -> tuple[list[int] | int, int]:
    """Outside the layers: the tags of an op's outputs (a foreach op's i-th output the tag of
    its first list's i-th tensor, any other op's the one tag its inputs share), and the op's
    own, from the storages' `tags` and the gradient views' `views`."""
    if func.__name__.startswith("_foreach_") and args and isinstance(args[0], list | tuple):
        per_output = [
            _or_sticky(tag_of(t, tags, views)) if isinstance(t, torch.Tensor) else STICKY
            for t in args[0]
        ]
        distinct = set(per_output)
        return per_output, (distinct.pop() if len(distinct) == 1 else FIXED)
    found = {
        tag
        for t in pytree.tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor) and (tag := tag_of(t, tags, views)) is not None
    }
    if not found:
        return STICKY, STICKY
    if len(found) == 1:
        tag = found.pop()
        return tag, tag
    return FIXED, FIXED


class LayerContexts:
    """Which layer's forward or backward is running, from hooks on `layers` (the model's
    decoder layers, in order)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.stack: list[int] = []
        self.backward_layer = NO_LAYER
        for index, layer in enumerate(layers):
            # Around whatever other hooks the layer has (FSDP2's gather before its forward and
            # free after it are the layer's events), and heard of first when the backward
            # reaches the layer's output (FSDP2's pre-backward gathers the layer and prefetches
            # the next one: the layer's events too).
            layer.register_forward_pre_hook(functools.partial(self._enter, index), prepend=True)
            layer.register_forward_hook(functools.partial(self._output, index), prepend=True)
            layer.register_forward_hook(self._leave)

    def reset(self) -> None:
        self.stack.clear()
        self.backward_layer = NO_LAYER

    def current(self, phase: Phase) -> int:
        if self.stack:
            return self.stack[-1]
        if phase is Phase.BACKWARD:
            return self.backward_layer
        return NO_LAYER

    def _enter(self, index: int, module: nn.Module, args: Any) -> None:
        self.stack.append(index)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.stack.pop()

    def _output(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for tensor in pytree.tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                hook = functools.partial(self._backward_of, index)
                tensor.register_hook(hook)  # type: ignore[no-untyped-call]
                return

    def _backward_of(self, index: int, grad: torch.Tensor) -> None:
        self.backward_layer = index


class JournalTracker(LiveBytesTracker):  # type: ignore[no-untyped-call]
    """A `LiveBytesTracker` that also writes `journal` (module docstring). `tags` maps the
    storages of the parameters, gradients and optimizer state to their layer (FIXED outside
    the layers), `categories` the weights' and optimizer state's storages to theirs; both are
    the caller's, made before the step (`autotune.engine.replay.layer_replay`)."""

    def __init__(
        self,
        *args: Any,
        contexts: LayerContexts,
        tags: dict[int, int],
        categories: dict[int, int],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.contexts = contexts
        self.tags = tags
        self.categories = categories
        # Gradients that are views of a shared storage (DDP's buckets), by view, and the views
        # of each such storage.
        self.views: dict[ViewKey, int] = {}
        self._views_of: dict[int, list[ViewKey]] = {}
        self.journal: list[tuple[Any, ...]] = []
        self._journal_index: dict[int, int] = {}  # allocation event -> its journal index
        self._output_tags: list[int] | int | None = None  # None: residents, looked up
        self._count_tag = FIXED
        self._count_key: int | None = None
        self._added_bytes = 0
        # Each registered parameter's gradient storage the journal holds, by the parameter's id
        # (its `.grad` may be gone by the time the parameter is swapped out).
        self._held_gradients: dict[int, _StorageRef] = {}
        self._original_setattr_on_modules: Any = None
        contexts.reset()

    def add_resident(
        self, tensors: Iterable[torch.Tensor], placement: ResidentPlacement | None = None
    ) -> None:
        super().add_resident(tensors, placement)
        # The residents' allocations end here: a replay places them as the tracker did
        # (`autotune.engine.replay.layer_replay.evaluate`).
        self.journal.append((MARK, NO_LAYER))

    def _count_deferred(self, backward: bool) -> None:
        # Counted as residents are (no op's outputs): tagged by their storage, FIXED.
        tags, self._output_tags = self._output_tags, None
        try:
            super()._count_deferred(backward)
        finally:
            self._output_tags = tags

    def _count(self, tensor: torch.Tensor) -> int:
        key = storage_key(tensor)
        tag = self._count_tag
        if self._output_tags is None:  # a resident, or a gradient already there
            tag = self.tags.get(key, FIXED) if key is not None else FIXED
        self._count_tag = tag
        self._count_key = key
        added = super()._count(tensor)
        if key is not None and tag != STICKY and key not in self.tags:
            if self.contexts.current(self.phase) == NO_LAYER:
                # What an op outside the layers makes from one layer's tensors is that layer's.
                self.tags[key] = tag
        return added

    def _count_outputs(self, out: object) -> int:
        tags = self._output_tags
        if isinstance(tags, list) and isinstance(out, (list, tuple)) and len(out) == len(tags):
            added = 0
            for item, tag in zip(out, tags, strict=True):
                self._count_tag = tag
                added += super()._count_outputs(item)
        else:
            self._count_tag = tags if isinstance(tags, int) else STICKY
            added = super()._count_outputs(out)
        self._added_bytes += added
        return added

    def _resized(self, ref: _StorageRef, nbytes: int) -> int:
        # A resized storage's allocation is of that storage's category (FSDP2 resizes its
        # gathered parameters' storages outside any op).
        self._count_key = ref.key
        return super()._resized(ref, nbytes)

    def _record_allocation(self, nbytes: int) -> int:
        event = super()._record_allocation(nbytes)
        if event >= 0:
            key = self._count_key
            category = self.categories.get(key, OTHER) if key is not None else OTHER
            self._journal_index[event] = len(self.journal)
            context = self.contexts.current(self.phase)
            self.journal.append((ALLOC, nbytes, context, self._count_tag, self.phase, category))
        return event

    def _record_free(self, ref: _StorageRef) -> None:
        if ref.event >= 0 and self._active:
            context = self.contexts.current(self.phase)
            self.journal.append((FREE, self._journal_index[ref.event], context))
        super()._record_free(ref)

    def _release(self, ref: Any) -> None:
        key = ref.key
        if self._storages.get(key) is ref:
            self.tags.pop(key, None)
            for view in self._views_of.pop(key, ()):
                self.views.pop(view, None)
        super()._release(ref)

    def record_gradient(self, parameter: torch.Tensor, tag: int, number: int = -1) -> None:
        """`parameter.grad` is complete (a post-accumulate-grad hook): its storage is now a
        gradient, of `tag`'s layer (or, a view of a bucket, that view is), of the parameter
        `number`."""
        grad = parameter.grad
        key = storage_key(grad) if grad is not None else None
        ref = self._storages.get(key) if key is not None else None
        if grad is None or key is None or ref is None:
            return
        view = gradient_view(grad)
        if view is None:
            self.tags[key] = tag
        else:
            self.views[view] = tag
            self._views_of.setdefault(key, []).append(view)
        if ref.event >= 0 and self._active:
            context = self.contexts.current(self.phase)
            self.journal.append((GRAD, self._journal_index[ref.event], context, number))
            self._held_gradients[id(parameter)] = ref

    # ---------------------------------------------------------------------------------------
    # Which parameters are registered on the model: FSDP2 swaps a block's shards for its
    # gathered parameters while the block runs (module docstring).

    _active_tracker: ClassVar[JournalTracker | None] = None

    def _live_event(self, tensor: torch.Tensor | None) -> _StorageRef | None:
        """The counted, journaled storage of `tensor` (None: none, or not journaled)."""
        if tensor is None:
            return None
        key = storage_key(tensor)
        ref = self._storages.get(key) if key is not None else None
        return ref if ref is not None and ref.event >= 0 else None

    def _registered(self, old: torch.Tensor | None, new: torch.Tensor) -> None:
        """FSDP2 registered `new` on its module in place of `old`: the journal drops `old`'s
        storage and the gradient it held for it, and holds `new`'s and its `.grad`'s."""
        if not self._active:
            return
        context = self.contexts.current(self.phase)
        index = self._journal_index
        if old is not None and old is not new:
            ref = self._live_event(old)
            if ref is not None:
                self.journal.append((DROP, index[ref.event], context))
            held = self._held_gradients.pop(id(old), None)
            if held is not None and self._storages.get(held.key) is held:
                self.journal.append((UNGRAD, index[held.event], context))
        ref = self._live_event(new)
        if ref is not None:
            self.journal.append((HOLD, index[ref.event], context))
        grad = self._live_event(new.grad)
        if grad is not None:
            self.journal.append((GRAD, index[grad.event], context, -1))
            self._held_gradients[id(new)] = grad
        hooks = getattr(new, "_post_accumulate_grad_hooks", None) or {}
        if new.requires_grad and _gathered_gradient not in hooks.values():
            # A gathered parameter's gradient is accumulated on it by autograd and taken off
            # it by FSDP2's post-backward, before the swap back to the shards.
            new.register_post_accumulate_grad_hook(_gathered_gradient)  # type: ignore[no-untyped-call]

    def _gathered_gradient(self, parameter: torch.Tensor) -> None:
        """`parameter` (registered, gathered) received its gradient."""
        ref = self._live_event(parameter.grad)
        if ref is not None and self._active:
            context = self.contexts.current(self.phase)
            self.journal.append((GRAD, self._journal_index[ref.event], context, -1))
            self._held_gradients[id(parameter)] = ref

    def __enter__(self) -> JournalTracker:
        fsdp_param = sys.modules.get(_FSDP_PARAM_MODULE)
        if fsdp_param is not None:
            parameter_class = fsdp_param.FSDPParam
            original = parameter_class._setattr_on_modules
            self._original_setattr_on_modules = original
            tracker = self

            def _setattr_on_modules(parameter: Any, tensor: torch.Tensor) -> None:
                info = parameter._module_info
                old = info.module._parameters.get(info.param_name)
                original(parameter, tensor)
                tracker._registered(old, tensor)

            parameter_class._setattr_on_modules = _setattr_on_modules
        JournalTracker._active_tracker = self
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        JournalTracker._active_tracker = None
        original = self._original_setattr_on_modules
        if original is not None:
            sys.modules[_FSDP_PARAM_MODULE].FSDPParam._setattr_on_modules = original
            self._original_setattr_on_modules = None

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if id(func) in _UNCOUNTED_OP_IDS:
            if id(func) in MARKER_OP_IDS:
                # A record_function's markers (the optimizer's step and zero_grad open one)
                # part what comes before them from what comes after, say two sweeps of frees.
                # A device query is no boundary: FSDP2 makes one beside each parameter's view,
                # which would cut a layer's run into one run per parameter.
                phase = Phase.OPTIMIZER if self._in_optimizer else self.phase
                self.journal.append((MARK, self.contexts.current(phase)))
            # Uncounted (the tracker's own path for these); most are device queries, two for
            # every counted op of a trace on fake tensors.
            return uncounted(func, args, kwargs)
        kwargs = kwargs or {}
        # The phase as the tracker will decide it; a backward pass starts outside the layers.
        backward = not self._in_optimizer and _current_graph_task_id() != -1
        if backward and self.phase is not Phase.BACKWARD:
            self.contexts.backward_layer = NO_LAYER
        phase = (
            Phase.OPTIMIZER
            if self._in_optimizer
            else (Phase.BACKWARD if backward else Phase.FORWARD)
        )
        context = self.contexts.current(phase)
        tag = STICKY
        self._output_tags = STICKY
        if context == NO_LAYER:
            self._output_tags, tag = output_tags(func, args, kwargs, self.tags, self.views)
        previous_phase = self.phase
        self._added_bytes = 0
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._output_tags = None
        peak_check = self._added_bytes > 0 or self.phase is not previous_phase
        self.journal.append((OP, context, tag, self.phase, peak_check, func))
        return out


def _gathered_gradient(parameter: torch.Tensor) -> None:
    """A gathered parameter's gradient hook: heard by the journal's tracker while one runs."""
    tracker = JournalTracker._active_tracker
    if tracker is not None:
        tracker._gathered_gradient(parameter)


def parameter_tags(
    layers: Sequence[nn.Module],
    model: nn.Module,
    optimizer_state: dict[Any, dict[str, Any]],
) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """Before a step: the storages' layer tags (parameters, their gradients, their optimizer
    state; buffers and parameters outside the layers FIXED), their categories (weights,
    optimizer state), and each parameter's tag by id."""
    tags: dict[int, int] = {}
    categories: dict[int, int] = {}
    by_parameter: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for parameter in layer.parameters():
            by_parameter[id(parameter)] = index
    entries: list[tuple[torch.Tensor, int, int]] = []
    for parameter in model.parameters():
        tag = by_parameter.get(id(parameter), FIXED)
        by_parameter.setdefault(id(parameter), tag)
        entries.append((parameter, tag, WEIGHT))
        if parameter.grad is not None:
            entries.append((parameter.grad, tag, OTHER))
        for value in optimizer_state.get(parameter, {}).values():
            if isinstance(value, torch.Tensor):
                entries.append((value, tag, OPTIMIZER_STATE))
    entries += [(buffer, FIXED, WEIGHT) for buffer in model.buffers()]
    for tensor, tag, category in entries:
        key = storage_key(tensor)
        if key is not None:
            tags[key] = tag
            categories[key] = category
    return tags, categories, by_parameter
