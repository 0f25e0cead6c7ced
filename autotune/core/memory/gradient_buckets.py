"""DDP's gradient buckets as torch 2.13 lays them out: which tensors share one flat buffer.

Torch-free. `assign_buckets` is c10d's
`compute_bucket_assignment_by_size`, which `DistributedDataParallel` uses three ways:
with one unlimited bucket per dtype at construction, with the 1 MiB first and 25 MiB further
limits when its reducer rebuilds the buckets in the order gradients became ready (after the
first synchronised backward), and with 250 MiB limits to coalesce the buffers it broadcasts at
the start of a forward. What the buckets cost one rank: docs/design.md#data-parallel.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

_MiB = 2**20

# DistributedDataParallel's defaults: _DEFAULT_BUCKET_CAP_MB, dist._DEFAULT_FIRST_BUCKET_BYTES
# and DistributedDataParallel.broadcast_bucket_size.
BUCKET_CAP_BYTES = 25 * _MiB
FIRST_BUCKET_CAP_BYTES = 1 * _MiB
BROADCAST_BUCKET_BYTES = 250 * _MiB
# c10d's broadcast_coalesced keeps at most two flat buffers
# in flight.
BROADCAST_IN_FLIGHT = 2

# Construction without find_unused_parameters or static_graph: no size limit, so one bucket per
# dtype and device until the reducer rebuilds them (_BucketCapacityConfig.
# compute_bucket_size_limits).
CONSTRUCTION_LIMITS: tuple[int, ...] = (sys.maxsize,)
REBUILT_LIMITS: tuple[int, ...] = (FIRST_BUCKET_CAP_BYTES, BUCKET_CAP_BYTES)
BROADCAST_LIMITS: tuple[int, ...] = (BROADCAST_BUCKET_BYTES,)


@dataclass(frozen=True)
class BucketTensor:
    """One tensor to place: its size, and its kind (dtype and device): only tensors of one
    kind share a bucket."""

    nbytes: int
    kind: Hashable


def assign_buckets(
    tensors: Sequence[BucketTensor], size_limits: Sequence[int], *, ready_order: bool
) -> list[list[int]]:
    """The buckets `compute_bucket_assignment_by_size` makes, as lists of positions in `tensors`.

    Per kind, tensors join the open bucket in order; a bucket closes as soon as its size reaches
    the current limit, and each closed bucket moves that kind to the next limit (the last one
    repeats). The open buckets left at the end follow, in the order their kinds first appeared.
    With `ready_order` (the reducer's rebuild, `tensors` in the order gradients became ready)
    buckets keep that order; otherwise they are sorted by the first tensor each holds.

    Raises:
        ValueError: no tensors or no limits.
    """
    if not tensors or not size_limits:
        raise ValueError("assign_buckets needs tensors and at least one size limit")
    closed: list[list[int]] = []
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    limit_index: dict[Hashable, int] = {}
    for position, tensor in enumerate(tensors):
        bucket = open_buckets.setdefault(tensor.kind, [])
        bucket.append(position)
        size = open_bytes.get(tensor.kind, 0) + tensor.nbytes
        index = limit_index.setdefault(tensor.kind, 0)
        if size >= size_limits[index]:
            closed.append(bucket)
            del open_buckets[tensor.kind]
            size = 0
            limit_index[tensor.kind] = min(index + 1, len(size_limits) - 1)
        open_bytes[tensor.kind] = size
    buckets = closed + list(open_buckets.values())
    if not ready_order:
        buckets.sort(key=min)
    return buckets


def bucket_bytes(tensors: Sequence[BucketTensor], buckets: Sequence[Sequence[int]]) -> list[int]:
    """Each bucket's flat buffer size: its tensors' bytes, packed without padding (the reducer's
    `initialize_buckets` allocates exactly the sum of their element counts)."""
    return [sum(tensors[position].nbytes for position in bucket) for bucket in buckets]
