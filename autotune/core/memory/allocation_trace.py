"""A recorded sequence of allocations and frees, replayed through the caching-allocator model:
what a device of a given size would reserve for it, and whether it runs out
(docs/design.md#the-caching-allocator-model); and `AllocationModel`, the traces of one step fitted
affinely in the micro-batch, which predicts by replay where a step runs out on reserved memory
(docs/design.md#predicting-reserved-memory). A trace that starts from the residents where the
warm-up left them carries its `TrialStart`, and is replayed from there.

A trace travels encoded as integers, as the tracker records it: a size >= 0 is a storage of that
many bytes allocated, -(n + 1) the free of the storage allocated by event n.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from autotune.core.memory.allocator import (
    AllocatorOutOfMemory,
    AllocatorStats,
    BlockId,
    CachingAllocator,
)
from autotune.core.memory.allocator_config import AllocatorConfig
from autotune.core.memory.resident_placement import TrialStart


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


def encode(events: Iterable[Event]) -> list[int]:
    """The integer encoding of `events`."""
    return [e.size_bytes if isinstance(e, Alloc) else -(e.alloc_event + 1) for e in events]


def replay(
    events: Iterable[Event], capacity_bytes: int, config: AllocatorConfig | None = None
) -> ReplayResult:
    """Replay `events` on a fresh allocator of `capacity_bytes`; stop at the first allocation
    that runs out, as a training step would.

    Raises:
        ValueError: a `Free` names no earlier `Alloc`, or one already freed.
    """
    return replay_encoded(encode(events), capacity_bytes, config)


def replay_encoded(
    trace: Sequence[int],
    capacity_bytes: int,
    config: AllocatorConfig | None = None,
    start: TrialStart | None = None,
) -> ReplayResult:
    """`replay` of an encoded trace; from `start`'s placement of its residents (its first
    events) when given, as the trial it was recorded in started."""
    allocator = CachingAllocator(capacity_bytes, config)
    live: dict[int, BlockId] = {}
    first = 0
    if start is not None:
        first = start.resident_events
        try:
            blocks = start.placement.place(allocator, trace[:first])
        except AllocatorOutOfMemory as error:
            return ReplayResult(allocator.stats, error, 0)
        live = dict(enumerate(blocks))
    for position in range(first, len(trace)):
        event = trace[position]
        if event >= 0:
            try:
                live[position] = allocator.malloc(event)
            except AllocatorOutOfMemory as error:
                return ReplayResult(allocator.stats, error, position)
        else:
            block = live.pop(-event - 1, None)
            if block is None:
                raise ValueError(
                    f"event {position} frees event {-event - 1}, which holds no storage"
                )
            allocator.free(block)
    return ReplayResult(allocator.stats)


@dataclass(frozen=True)
class AllocationModel:
    """A step's allocations fitted on two encoded traces at micro-batches b1 < b2 (both >= 2)
    with the same events in the same order: every allocation's size is affine in b (a tensor's
    bytes are its batch-dependent elements times b plus the rest), so the trace at any b is
    known, and replaying it says what the allocator reserves there and whether it runs out.

    Sizes are stored as base + (b - b1) * delta / span, rounded up, so non-integer slopes stay
    within a byte; frees carry a delta of 0. Both traces started from `start` (None: a fresh
    allocator), and so does every replay.

    A replay is a pure function of the model, the micro-batch, the capacity and the settings,
    and one search asks for the same few again and again (its fit points, the check that the
    replay agrees with every trial, the dips below the answer, the recommendation: 18 replays
    of 4 sizes in a 70B probe, each of an 80-layer trace), so each is replayed once and kept.
    """

    base_micro_batch: int
    span_micro_batches: int
    base: tuple[int, ...]
    delta_bytes: tuple[int, ...]
    start: TrialStart | None = None
    _replays: dict[tuple[int, int, AllocatorConfig | None], ReplayResult] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _live_peaks: dict[int, int] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def fit(
        cls,
        b1: int,
        trace1: Sequence[int],
        b2: int,
        trace2: Sequence[int],
        *,
        starts: tuple[TrialStart | None, TrialStart | None] = (None, None),
    ) -> AllocationModel | None:
        """Fit on traces at `b1` < `b2` that started from `starts`; None when their events
        differ (length, or which allocation each free frees), they are empty, `b1` < 2, or
        they started from different placements."""
        if b2 <= b1:
            raise ValueError(f"need b1 < b2, got b1={b1}, b2={b2}")
        if b1 < 2 or len(trace1) != len(trace2) or not trace1 or starts[0] != starts[1]:
            return None
        for event1, event2 in zip(trace1, trace2, strict=True):
            if (event1 < 0 or event2 < 0) and event1 != event2:
                return None
        return cls(
            base_micro_batch=b1,
            span_micro_batches=b2 - b1,
            base=tuple(trace1),
            delta_bytes=tuple(
                0 if e1 < 0 else e2 - e1 for e1, e2 in zip(trace1, trace2, strict=True)
            ),
            start=starts[0],
        )

    def trace(self, micro_batch: int) -> list[int]:
        """The predicted encoded trace at `micro_batch`."""
        steps, span = micro_batch - self.base_micro_batch, self.span_micro_batches
        return [
            event if event < 0 else max(0, -(-(event * span + steps * delta) // span))
            for event, delta in zip(self.base, self.delta_bytes, strict=True)
        ]

    def replay(
        self, micro_batch: int, capacity_bytes: int, config: AllocatorConfig | None = None
    ) -> ReplayResult:
        """The predicted step at `micro_batch` on a device of `capacity_bytes`."""
        key = (micro_batch, capacity_bytes, config)
        result = self._replays.get(key)
        if result is None:
            result = self._replays[key] = replay_encoded(
                self.trace(micro_batch), capacity_bytes, config, self.start
            )
        return result

    def live_peak_bytes(self, micro_batch: int) -> int:
        """The most bytes the predicted trace at `micro_batch` holds at once (as requested,
        before the allocator rounds or caches): a lower bound of what it reserves."""
        peak = self._live_peaks.get(micro_batch)
        if peak is None:
            peak = self._live_peaks[micro_batch] = self._live_peak_bytes(micro_batch)
        return peak

    def _live_peak_bytes(self, micro_batch: int) -> int:
        sizes: list[int] = []
        live = peak = 0
        for event in self.trace(micro_batch):
            if event >= 0:
                sizes.append(event)
                live += event
                peak = max(peak, live)
            else:
                sizes.append(0)
                live -= sizes[-event - 1]
        return peak

    def largest_fitting(
        self,
        capacity_bytes: int,
        config: AllocatorConfig | None = None,
        *,
        above: int,
        high: int,
        budget_bytes: int | None = None,
    ) -> int | None:
        """The largest b in (`above`, `high`) whose predicted step fits on `capacity_bytes` (and
        reserves at most `budget_bytes` there, if given), or None. Every size is replayed, from
        the top down, since the allocator's caching makes a step's memory non-monotone in b
        (some sizes run out where larger ones fit: docs/design.md#memory-that-is-not-monotone).
        Sizes whose requested bytes alone exceed the limit are skipped without a replay: when no
        allocation shrinks with b, those are a top range, found by bisection."""
        limit_bytes = capacity_bytes if budget_bytes is None else min(capacity_bytes, budget_bytes)
        top = high
        if all(delta >= 0 for delta in self.delta_bytes):
            low = above
            while top - low > 1:
                middle = (low + top) // 2
                if self.live_peak_bytes(middle) <= limit_bytes:
                    low = middle
                else:
                    top = middle
            top = low + 1
        for micro_batch in range(top - 1, above, -1):
            predicted = self.replay(micro_batch, capacity_bytes, config)
            if predicted.fits and predicted.stats.peak_reserved_bytes <= limit_bytes:
                return micro_batch
        return None
