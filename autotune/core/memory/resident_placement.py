"""Where a card's warm-up leaves the residents (weights, optimizer state, BLAS workspaces): the
state of the caching allocator every later trial starts from
(docs/design.md#the-caching-allocator-on-the-emulated-gpu).

On a card the residents are allocated by the model's construction, the first backward and the
first optimizer step, interleaved with that step's activations; each later trial starts from
`empty_cache()` with them where the warm-up put them. `ResidentPlacement` is that state as a
recipe: the warm-up's encoded allocation trace (`autotune.core.memory.allocation_trace`'s
encoding), whose allocations never freed in it are the residents. `place` replays it into a
fresh allocator model, frees what no resident holds any more, `empty_cache()`s and hands each
resident of the new trial its block, so every trial (and every replay that predicts one) starts
from the same state. `TrialStart` says where a trial's trace started: its first allocations are
the residents, placed so.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.core.memory.allocator import NO_BLOCK, BlockId, CachingAllocator


@dataclass(frozen=True, slots=True)
class ResidentPlacement:
    """The warm-up's allocations and frees in order, encoded; those never freed are the
    residents a later trial finds. Plain integers: it crosses process boundaries with the
    outcomes that carry it."""

    warm_up: tuple[int, ...]

    def place(self, allocator: CachingAllocator, resident_bytes: Sequence[int]) -> list[BlockId]:
        """Put a fresh `allocator` in the state the warm-up left, for a trial whose residents
        are storages of `resident_bytes` (in the order the trial counts them); return each
        one's block.

        A resident takes the first block the warm-up left of its size (its own: residents are
        counted in the order they were made, weights before optimizer state, and blocks of one
        size are interchangeable to the allocator). Blocks no resident takes are freed (a
        tensor the warm-up kept that is gone), residents the warm-up did not make are
        malloc'd, and then, as before every trial on a card, the cache is emptied and the
        peaks and retry counts restart.

        Raises:
            AllocatorOutOfMemory: the allocator cannot hold the warm-up or the residents.
        """
        live: dict[int, BlockId] = {}
        for position, event in enumerate(self.warm_up):
            if event >= 0:
                live[position] = allocator.malloc(event)
            else:
                allocator.free(live.pop(-event - 1))
        by_size: dict[int, deque[BlockId]] = {}
        for position, block in live.items():  # in allocation order
            by_size.setdefault(self.warm_up[position], deque()).append(block)
        blocks: list[BlockId | None] = []
        for nbytes in resident_bytes:
            kept = by_size.get(nbytes)
            blocks.append(NO_BLOCK if nbytes == 0 else kept.popleft() if kept else None)
        for unclaimed in by_size.values():
            for block in unclaimed:
                allocator.free(block)
        placed = [
            allocator.malloc(nbytes) if block is None else block
            for nbytes, block in zip(resident_bytes, blocks, strict=True)
        ]
        allocator.empty_cache()
        allocator.reset_peaks()
        allocator.reset_accumulated_stats()
        return placed


@dataclass(frozen=True, slots=True)
class TrialStart:
    """Where a trial's encoded trace starts: its first `resident_events` events are the
    residents' allocations, placed by `placement` rather than malloc'd into a fresh
    allocator."""

    placement: ResidentPlacement
    resident_events: int
