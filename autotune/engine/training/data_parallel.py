"""Data parallelism in one process: the memory torch's DistributedDataParallel adds to each rank,
reproduced without communication, so that a single-process trial counts it.

`EmulatedReducer` does with a model's memory what DDP's C++ reducer does with it (torch 2.13's
c10d reducer, DDP as `autotune.core.exports` exports it:
`gradient_as_bucket_view=True`, default bucket sizes, no unused parameters):

* flat gradient buckets, one per dtype until the first synchronised backward, then rebuilt in
  the order gradients became ready with 1 MiB / 25 MiB limits (`rebuild_buckets`, before the
  next forward); they live as long as the model, so they are resident in every step;
* on the micro-batch that synchronises (the last of an accumulated step; the others run under
  `no_sync()`), each gradient is copied into its bucket once accumulated, and with
  `gradient_as_bucket_view` the gradient then becomes a view of the bucket, which frees the
  separate gradient (`mark_variable_ready_dense`);
* at the first forward of every step, the module's buffers are flattened in chunks of up to
  250 MiB, two at a time, to be broadcast (`_sync_buffers`, `broadcast_coalesced`).

The all-reduce itself runs in place on the buckets (gloo and NCCL allocate nothing through
torch's allocator), so nothing stands for it; gradients keep their single-process values.
docs/design.md#data-parallel.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils.hooks import RemovableHandle

from autotune.core.bytesize import format_bytes
from autotune.core.memory.gradient_buckets import (
    BROADCAST_IN_FLIGHT,
    BROADCAST_LIMITS,
    CONSTRUCTION_LIMITS,
    REBUILT_LIMITS,
    BucketTensor,
    assign_buckets,
)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters DDP reduces, in its order: module by module, those that require grad,
    each shared parameter once (`DistributedDataParallel._build_params_for_reducer`)."""
    seen: set[int] = set()
    params: list[nn.Parameter] = []
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def _bucket_tensor(tensor: torch.Tensor) -> BucketTensor:
    return BucketTensor(tensor.numel() * tensor.element_size(), (tensor.dtype, tensor.device))


class EmulatedReducer:
    """DDP's reducer for one rank, without communication. Build it once per model; drive each
    micro-batch through `micro_batch`; count `buckets` as resident.

    Args:
        model: the module DDP would wrap.
        gradient_as_bucket_view: DDP's flag. True (what is exported): gradients become views of
            the buckets once synchronised. False (DDP's default): they stay separate, so a
            second copy of every gradient exists while the buckets do.
    """

    def __init__(self, model: nn.Module, *, gradient_as_bucket_view: bool = True) -> None:
        self._model = model
        self._params = trainable_parameters(model)
        if not self._params:
            raise ValueError("DDP needs at least one parameter that requires grad")
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._buckets: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        # The reducer lists its buckets in reverse: gradients arrive roughly last layer first.
        self._build(
            list(range(len(self._params))), CONSTRUCTION_LIMITS, ready_order=False, reverse=True
        )
        self._syncing = False
        self._rebuilt = False
        self._ready_order: list[int] = []
        # The reducer's post-hook on each gradient accumulator runs where this hook runs.
        self._hooks: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._on_gradient_ready)  # type: ignore[no-untyped-call]
            for p in self._params
        ]

    @property
    def buckets(self) -> tuple[torch.Tensor, ...]:
        """The flat gradient buckets: allocated with the model, so resident in every step."""
        return tuple(self._buckets)

    @property
    def rebuilt(self) -> bool:
        """Whether the buckets were rebuilt in the order gradients became ready."""
        return self._rebuilt

    @property
    def ready_order(self) -> tuple[int, ...]:
        """The parameters (by their place in DDP's order) in the order their gradients became
        ready in the first synchronised backward that reached them all (empty before)."""
        return tuple(self._ready_order)

    def forget_ready_order(self) -> None:
        """Before the rebuild, forget a recorded ready order, as a synchronised backward cut
        short by an out-of-memory leaves none (the layer replay's shallow model completes a
        step that the deep one does not)."""
        if not self._rebuilt:
            self._ready_order = []

    def bucket_sizes_bytes(self) -> list[int]:
        return [b.numel() * b.element_size() for b in self._buckets]

    def assumption(self, world_size: int, bucket_bytes: int | None = None) -> str:
        """What a trial counts for data parallelism, as `DeviceInfo.assumptions` states it;
        `bucket_bytes`: the buckets' total, when not these (the layer replay's deep model's)."""
        flag = self.gradient_as_bucket_view
        total = sum(self.bucket_sizes_bytes()) if bucket_bytes is None else bucket_bytes
        return (
            f"data parallel, {world_size} ranks: each holds torch DDP's gradient buckets "
            f"({format_bytes(total)}, resident) with "
            f"gradient_as_bucket_view={flag}, 25 MiB buckets, buffers flattened before each "
            "step; the all-reduce itself and NCCL's buffers are not tensors of the step"
        )

    def remove(self) -> None:
        """Stop acting on the model's gradients (the hooks go; the buckets are dropped)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._buckets, self._views = [], []

    @contextlib.contextmanager
    def micro_batch(self, *, first: bool, sync: bool) -> Iterator[None]:
        """Forward and backward of one micro-batch: `first` of its optimizer step (DDP's forward
        then rebuilds the buckets once, and flattens the buffers to broadcast them), and whether
        its backward synchronises (the last micro-batch; the others run under `no_sync()`)."""
        if first:
            self.rebuild_if_due()
            self._flatten_buffers()
        self._syncing = sync
        try:
            yield
        finally:
            self._syncing = False
            if not self._rebuilt and len(self._ready_order) != len(self._params):
                # A backward that did not reach every parameter (out of memory) records nothing.
                self._ready_order = []

    # -------------------------------------------------------------------------------------

    def _build(
        self, order: Sequence[int], limits: Sequence[int], *, ready_order: bool, reverse: bool
    ) -> None:
        tensors = [_bucket_tensor(self._params[i]) for i in order]
        groups = assign_buckets(tensors, limits, ready_order=ready_order)
        if reverse:
            groups.reverse()
        # Old buckets go before new ones are made, as initialize_buckets clears them first.
        self._buckets, self._views = [], []
        views: list[torch.Tensor | None] = [None] * len(self._params)
        for group in groups:
            members = [self._params[order[position]] for position in group]
            numel = sum(p.numel() for p in members)
            flat = torch.empty(numel, dtype=members[0].dtype, device=members[0].device)
            offset = 0
            for param in members:
                # initialize_bucket_views: a dense parameter's view keeps its strides (as its
                # gradient will), any other is a contiguous slice.
                if is_non_overlapping_and_dense_or_false(param):
                    view = flat.as_strided(param.shape, param.stride(), offset)
                else:
                    view = flat.narrow(0, offset, param.numel()).view(param.shape)
                views[self._index[id(param)]] = view
                offset += param.numel()
            self._buckets.append(flat)
        assert all(view is not None for view in views)
        self._views = [view for view in views if view is not None]
        if self.gradient_as_bucket_view:
            # Gradients that survived into a rebuild move into the new buckets.
            for param, view in zip(self._params, self._views, strict=True):
                if param.grad is not None:
                    view.copy_(param.grad)
                    param.grad = view

    def rebuild_if_due(self) -> None:
        """Rebuild the buckets in gradient-ready order once a synchronised backward has
        recorded it (the reducer does so before the next forward). Call it between steps, when
        nothing but the resident state is alive, so that the old buckets are gone before the
        new ones exist; the next step's first micro-batch does it otherwise."""
        if self._rebuilt or len(self._ready_order) != len(self._params):
            return
        self._build(self._ready_order, REBUILT_LIMITS, ready_order=True, reverse=False)
        self._rebuilt = True

    def _flatten_buffers(self) -> None:
        buffers = list(self._model.buffers())
        if not buffers:
            return
        chunks = assign_buckets(
            [_bucket_tensor(b) for b in buffers], BROADCAST_LIMITS, ready_order=False
        )
        in_flight: deque[torch.Tensor] = deque()
        with torch.no_grad():
            for chunk in chunks:
                if len(in_flight) >= BROADCAST_IN_FLIGHT:
                    in_flight.popleft()
                # flatten_dense_tensors: one tensor is only viewed flat, several are
                # concatenated into a new buffer.
                flats = [buffers[i].contiguous().view(-1) for i in chunk]
                in_flight.append(flats[0] if len(flats) == 1 else torch.cat(flats))
        in_flight.clear()

    def _on_gradient_ready(self, param: torch.Tensor) -> None:
        if not self._syncing:
            return
        index = self._index[id(param)]
        if not self._rebuilt:
            self._ready_order.append(index)
        grad = param.grad
        if grad is None:
            return
        view = self._views[index]
        # The same storage, compared by its StorageImpl: a fake tensor (the estimate) has no
        # data pointer, every one of them reads 0.
        if grad.untyped_storage()._cdata == view.untyped_storage()._cdata:
            return  # already the bucket's view: reduced in place
        view.copy_(grad)
        if self.gradient_as_bucket_view:
            param.grad = view
