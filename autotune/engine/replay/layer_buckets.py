"""The layer replay's DDP buckets: a deep decoder's gradient buckets from a shallow one's.

DDP's reducer (`autotune.engine.training.data_parallel`) packs the trainable parameters into
flat buckets: one per dtype until the first synchronised backward, then, rebuilt in the order
the gradients became ready, buckets closed at 1 MiB and 25 MiB
(`autotune.core.memory.gradient_buckets`). A bucket spans as many layers as its bytes allow, so
a deep model's buckets are no repetition of a shallow one's: their number and sizes follow the
depth. They are a pure function of the parameters' sizes and ready order, though, and a
decoder's parameters are the parameters outside the layers and one layer's, once per layer, as
its ready order is those outside the layers read last layer first and each layer's in one
order. `LayerBuckets` writes the deep model's parameters and ready order out from the shallow
model's and lays out the deep buckets as the reducer does;
`autotune.engine.replay.layer_replay.expand`
puts them in place of the shallow buckets in the journal, and sends each gradient that
becomes a view of a bucket to its deep parameter's bucket (docs/design.md#the-layer-replay).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotune.core.memory.gradient_buckets import (
    CONSTRUCTION_LIMITS,
    REBUILT_LIMITS,
    BucketTensor,
    assign_buckets,
)
from autotune.engine.emulation.layer_journal import NotReplayable


@dataclass(frozen=True)
class BucketLayout:
    """The deep model's buckets: each one's bytes in the order the reducer allocates them, and
    each deep parameter's bucket (by its number, the reducer's order)."""

    sizes_bytes: tuple[int, ...]
    bucket_of: tuple[int, ...]


class LayerBuckets:
    """The deep model's parameters and buckets from the shallow model's.

    Args:
        tensors: the shallow model's trainable parameters in the reducer's order (module by
            module): their bytes and kinds.
        layers: each one's decoder layer (None: outside the layers).
        traced_layers: the shallow model's layers; `depth`: the deep model's.

    Raises:
        NotReplayable: the parameters are not those outside the layers around one layer's
            repeated per layer, in layer order.
    """

    def __init__(
        self,
        tensors: Sequence[BucketTensor],
        layers: Sequence[int | None],
        traced_layers: int,
        depth: int,
    ) -> None:
        inside = [number for number, layer in enumerate(layers) if layer is not None]
        if not inside:
            raise NotReplayable("no trainable parameter in the layers")
        first, last = inside[0], inside[-1]
        per_layer, remainder = divmod(last - first + 1, traced_layers)
        if remainder or len(inside) != last - first + 1:
            raise NotReplayable("the layers' parameters are not one block per layer")
        self._prefix = first
        self._per_layer = per_layer
        self._suffix = len(layers) - last - 1
        self._layers = list(layers)
        self._depth = depth
        self._traced = traced_layers
        layer_tensors = [tensors[first + j] for j in range(per_layer)]
        for number in inside:
            layer, slot = divmod(number - first, per_layer)
            if layers[number] != layer or tensors[number] != layer_tensors[slot]:
                raise NotReplayable("the layers' parameters differ")
        self._tensors = [
            *tensors[:first],
            *layer_tensors * depth,
            *tensors[last + 1 :],
        ]

    @property
    def count(self) -> int:
        """The shallow model's trainable parameters."""
        return len(self._layers)

    def slot(self, number: int) -> int:
        """Shallow parameter `number`'s place in its layer (its number outside the layers)."""
        layer = self._layers[number]
        return number if layer is None else (number - self._prefix) % self._per_layer

    def layer_of(self, number: int) -> int | None:
        """Shallow parameter `number`'s layer (None: outside the layers)."""
        return self._layers[number]

    def deep_parameter(self, number: int, deep_layer: int | None) -> int:
        """The deep model's parameter standing for shallow parameter `number` in `deep_layer`
        (a parameter outside the layers: None)."""
        slot = self.slot(number)
        if deep_layer is None:
            if self._layers[number] is not None:
                raise NotReplayable(f"a layer's parameter {number} outside the layers")
            shift = 0 if number < self._prefix else self._per_layer * (self._depth - self._traced)
            return number + shift
        return self._prefix + deep_layer * self._per_layer + slot

    def construction(self) -> BucketLayout:
        """The buckets DDP makes with the model: one per kind, the last made first."""
        return self._layout(range(len(self._tensors)), CONSTRUCTION_LIMITS, reverse=True)

    def rebuilt(self, ready_order: Sequence[int]) -> BucketLayout:
        """The buckets rebuilt in the deep model's ready order, written out from the shallow
        model's `ready_order` (parameter numbers): those outside the layers before the
        layers, each layer's in one order from the last layer to the first, those after.

        Raises:
            NotReplayable: the shallow ready order is not of that shape.
        """
        before: list[int] = []
        after: list[int] = []
        in_layers: list[tuple[int, int]] = []  # (layer, slot)
        for number in ready_order:
            layer = self._layers[number]
            if layer is None:
                (after if in_layers else before).append(number)
            elif after:
                raise NotReplayable("a layer's gradient ready after those outside the layers")
            else:
                in_layers.append((layer, self.slot(number)))
        slots = [slot for _, slot in in_layers[: self._per_layer]]
        expected = [(layer, slot) for layer in reversed(range(self._traced)) for slot in slots]
        if in_layers != expected:
            raise NotReplayable("the layers' gradients are not ready layer by layer alike")
        order = [
            *(self.deep_parameter(number, None) for number in before),
            *(
                self._prefix + layer * self._per_layer + slot
                for layer in reversed(range(self._depth))
                for slot in slots
            ),
            *(self.deep_parameter(number, None) for number in after),
        ]
        if sorted(order) != list(range(len(self._tensors))):
            raise NotReplayable("the ready order misses parameters")
        return self._layout(order, REBUILT_LIMITS, reverse=False)

    def _layout(
        self, order: Sequence[int], limits: Sequence[int], *, reverse: bool
    ) -> BucketLayout:
        # As the reducer's `_build`: positions in `order`, reversed at construction.
        tensors = [self._tensors[number] for number in order]
        groups = assign_buckets(tensors, limits, ready_order=not reverse)
        if reverse:
            groups.reverse()
        bucket_of = [0] * len(self._tensors)
        sizes: list[int] = []
        for bucket, group in enumerate(groups):
            sizes.append(sum(tensors[position].nbytes for position in group))
            for position in group:
                bucket_of[order[position]] = bucket
        return BucketLayout(tuple(sizes), tuple(bucket_of))


@dataclass(frozen=True)
class JournalBuckets:
    """A trial's buckets for `autotune.engine.replay.layer_replay.expand`: the deep model's
    layout of
    the resident buckets the shallow journal allocates, and the parameters."""

    parameters: LayerBuckets
    layout: BucketLayout


__all__ = ["BucketLayout", "JournalBuckets", "LayerBuckets"]
