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
from the same state. What the warm-up leaves in an untouched allocator is a function of the
warm-up and the allocator's settings, so it is replayed once per settings and restored after.
`TrialStart` says where a trial's trace started: its first allocations are the residents,
placed so.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.core.memory.allocator import NO_BLOCK, BlockId, CachingAllocator


@dataclass(frozen=True, slots=True, weakref_slot=True)
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
        live = self._warmed_up(allocator)
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

    def _warmed_up(self, allocator: CachingAllocator) -> dict[int, BlockId]:
        """Replay the warm-up into `allocator`; return the block of each allocation it leaves
        live, by position. An untouched allocator gets the state the first replay under its
        settings left (every trial and replay of a session places the same warm-up on the
        same device: a 70B probe's ten placements of some 40,000 events took 1.7 CPU s)."""
        if not allocator.untouched:
            return self._replay_warm_up(allocator)
        settings = (
            allocator.capacity_bytes,
            allocator.device_total_bytes,
            allocator.limit_bytes,
            allocator.config,
        )
        saved = _WARMED_UP.get(id(self))
        if saved is None:
            saved = _WARMED_UP[id(self)] = {}
            weakref.finalize(self, _WARMED_UP.pop, id(self), None)
        state = saved.get(settings)
        if state is not None:
            allocator.restore(state[0])
            return dict(state[1])
        live = self._replay_warm_up(allocator)  # an out-of-memory saves nothing
        if len(saved) >= _SETTINGS_KEPT:
            del saved[next(iter(saved))]
        saved[settings] = (allocator.clone(), dict(live))
        return live

    def _replay_warm_up(self, allocator: CachingAllocator) -> dict[int, BlockId]:
        live: dict[int, BlockId] = {}
        for position, event in enumerate(self.warm_up):
            if event >= 0:
                live[position] = allocator.malloc(event)
            else:
                allocator.free(live.pop(-event - 1))
        return live


# The allocator each placement's warm-up left, and its live blocks, by the allocator's settings
# (capacity, device, limit, config); by the placement's id (hashing a warm-up of 40,000 events
# would cost more than the look-up saves), a few settings each, dropped with the placement.
_SETTINGS_KEPT = 4
_WARMED_UP: dict[int, dict[tuple[object, ...], tuple[CachingAllocator, dict[int, BlockId]]]] = {}


@dataclass(frozen=True, slots=True)
class TrialStart:
    """Where a trial's encoded trace starts: its first `resident_events` events are the
    residents' allocations, placed by `placement` rather than malloc'd into a fresh
    allocator."""

    placement: ResidentPlacement
    resident_events: int
