"""ResidentPlacement: the warm-up's allocations replayed into a fresh allocator model, the
residents' blocks handed to the next trial, the rest freed and the cache emptied."""

from __future__ import annotations

from autotune.core.memory.allocation_trace import replay_encoded
from autotune.core.memory.allocator import BlockId, CachingAllocator
from autotune.core.memory.allocator_config import parse_alloc_conf
from autotune.core.memory.resident_placement import ResidentPlacement, TrialStart

MiB = 2**20

# A warm-up: a 4 MiB weight, an 8 MiB activation, then a 4 MiB optimizer state made while the
# activation is live, the activation freed. All three share the first 20 MiB segment.
WARM_UP = (4 * MiB, 8 * MiB, 4 * MiB, -2)


def _layout(allocator: CachingAllocator) -> list[list[tuple[int, bool]]]:
    return [
        [(block.size_bytes // MiB, block.allocated) for block in segment.blocks]
        for segment in allocator.snapshot()
    ]


def test_the_residents_keep_their_blocks_and_the_warm_up_s_hole() -> None:
    allocator = CachingAllocator(64 * MiB)
    blocks = ResidentPlacement(WARM_UP).place(allocator, [4 * MiB, 4 * MiB])
    assert _layout(allocator) == [[(4, True), (8, False), (4, True), (4, False)]]
    stats = allocator.stats
    assert (stats.allocated_bytes, stats.reserved_bytes, stats.peak_reserved_bytes) == (
        8 * MiB,
        20 * MiB,
        20 * MiB,
    )
    assert stats.num_alloc_retries == 0
    # The first resident of a size takes the first block of that size: the weight its own.
    assert allocator.snapshot()[0].blocks[0].requested_bytes == 4 * MiB
    assert len(set(blocks)) == 2


def test_what_no_resident_takes_is_freed_and_new_residents_are_malloced() -> None:
    allocator = CachingAllocator(64 * MiB)
    # The optimizer state is gone (a copy of another size took its place): its block is freed
    # and merges with the hole and the tail, where the 2 MiB newcomer is placed.
    ResidentPlacement(WARM_UP).place(allocator, [4 * MiB, 2 * MiB])
    assert _layout(allocator) == [[(4, True), (2, True), (14, False)]]


def test_the_warm_up_s_retries_and_segments_freed_are_not_the_trial_s() -> None:
    allocator = CachingAllocator(40 * MiB)
    # The warm-up's 30 MiB found its first segment cached, freed it and retried; the resident
    # made after it sits in the 30 MiB segment. The retry is the warm-up's, not the trial's.
    warm_up = (8 * MiB, 8 * MiB, -1, -2, 30 * MiB, -5, 2 * MiB)
    ResidentPlacement(warm_up).place(allocator, [2 * MiB])
    stats = allocator.stats
    assert (stats.reserved_bytes, stats.num_alloc_retries, stats.num_segments) == (
        30 * MiB,
        0,
        1,
    )
    assert _layout(allocator) == [[(2, True), (28, False)]]


def test_a_trace_replayed_from_its_start_is_the_trial_it_was_recorded_in() -> None:
    placement = ResidentPlacement(WARM_UP)
    # A trial: the two residents, then two 6 MiB activations. From the warm-up's placement the
    # first takes the 8 MiB hole and the second finds 2 and 4 MiB free: a second segment.
    # Packed into a fresh allocator, both share the first segment's free 12 MiB.
    trace = [4 * MiB, 4 * MiB, 6 * MiB, 6 * MiB, -3, -4]
    from_start = replay_encoded(trace, 64 * MiB, start=TrialStart(placement, 2))
    assert from_start.stats.peak_reserved_bytes == 40 * MiB
    assert replay_encoded(trace, 64 * MiB).stats.peak_reserved_bytes == 20 * MiB
    allocator = CachingAllocator(64 * MiB)
    resident = placement.place(allocator, [4 * MiB, 4 * MiB])
    activations = [allocator.malloc(6 * MiB) for _ in range(2)]
    for block in [*activations, *resident]:
        allocator.free(block)
    assert allocator.stats.peak_reserved_bytes == from_start.stats.peak_reserved_bytes
    # A device too small for the warm-up: the replay runs out at the residents.
    assert replay_encoded(trace, 10 * MiB, start=TrialStart(placement, 2)).failed_event == 0


def _goes_on(allocator: CachingAllocator, blocks: list[BlockId]) -> list[object]:
    """The figures and segments of `allocator`, then of the mallocs and frees of a trial."""
    seen: list[object] = [allocator.stats, allocator.snapshot()]
    activations = [allocator.malloc(size * MiB) for size in (6, 6, 30, 1)]
    for block in [activations[1], blocks[0], activations[2]]:
        allocator.free(block)
    seen += [activations, allocator.malloc(12 * MiB), allocator.stats, allocator.snapshot()]
    return seen


def test_a_placement_restored_from_the_first_is_the_placement_replayed() -> None:
    # Three warm-ups whose states are kept: retries, a segment freed and a hole.
    warm_up = (8 * MiB, 8 * MiB, -1, -2, 30 * MiB, 3 * MiB, 4 * MiB, -6, 2 * MiB)
    residents = [30 * MiB, 2 * MiB, 4 * MiB, MiB]
    config = parse_alloc_conf("garbage_collection_threshold:0.5,per_process_memory_fraction:0.9")
    for settings in ({}, {"config": config}, {"device_total_bytes": 130 * MiB}):
        replayed = []
        for _ in range(3):
            # A new placement each time replays; the same placement restores after its first.
            for placement in (ResidentPlacement(warm_up), PLACEMENT):
                allocator = CachingAllocator(120 * MiB, **settings)  # type: ignore[arg-type]
                blocks = placement.place(allocator, residents)
                replayed.append([blocks, *_goes_on(allocator, blocks)])
        assert all(seen == replayed[0] for seen in replayed)
    # An allocator that ran something already gets the warm-up replayed on top of it.
    touched, fresh = CachingAllocator(120 * MiB), CachingAllocator(120 * MiB)
    for allocator in (touched, fresh):
        allocator.free(allocator.malloc(50 * MiB))
    kept = PLACEMENT.place(touched, residents)  # a state is saved for these settings
    new = ResidentPlacement(warm_up).place(fresh, residents)
    assert [kept, *_goes_on(touched, kept)] == [new, *_goes_on(fresh, new)]


PLACEMENT = ResidentPlacement((8 * MiB, 8 * MiB, -1, -2, 30 * MiB, 3 * MiB, 4 * MiB, -6, 2 * MiB))
