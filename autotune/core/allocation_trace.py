"""A recorded sequence of allocations and frees, replayed through the caching-allocator model:
what a device of a given size would reserve for it, and whether it runs out
(docs/design.md#the-caching-allocator-model).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from autotune.core.allocator import (
    AllocatorOutOfMemory,
    AllocatorStats,
    BlockId,
    CachingAllocator,
)
from autotune.core.allocator_config import AllocatorConfig


@dataclass(frozen=True, slots=True)
class Alloc:
    """A storage of `size_bytes` is allocated."""

    size_bytes: int


@dataclass(frozen=True, slots=True)
class Free:
    """The storage allocated by the event at position `alloc_event` of the trace is freed."""

    alloc_event: int


Event = Alloc | Free


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """The allocator's figures after the trace, or at the event that ran out.

    Attributes:
        stats: allocated, reserved, their peaks, retries, ... when the replay stopped.
        out_of_memory: the out-of-memory that stopped it (None: the whole trace fits).
        failed_event: the position of the allocation that ran out (None: none did).
    """

    stats: AllocatorStats
    out_of_memory: AllocatorOutOfMemory | None = None
    failed_event: int | None = None

    @property
    def fits(self) -> bool:
        return self.out_of_memory is None


def replay(
    events: Iterable[Event], capacity_bytes: int, config: AllocatorConfig | None = None
) -> ReplayResult:
    """Replay `events` on a fresh allocator of `capacity_bytes`; stop at the first allocation
    that runs out, as a training step would.

    Raises:
        ValueError: a `Free` names no earlier `Alloc`, or one already freed.
    """
    allocator = CachingAllocator(capacity_bytes, config)
    live: dict[int, BlockId] = {}
    for position, event in enumerate(events):
        if isinstance(event, Alloc):
            try:
                live[position] = allocator.malloc(event.size_bytes)
            except AllocatorOutOfMemory as error:
                return ReplayResult(allocator.stats, error, position)
        else:
            block = live.pop(event.alloc_event, None)
            if block is None:
                raise ValueError(
                    f"event {position} frees event {event.alloc_event}, which holds no storage"
                )
            allocator.free(block)
    return ReplayResult(allocator.stats)
