"""The caching-allocator model (docs/design.md#the-caching-allocator-model).

Hand-built sequences whose outcome follows from torch 2.13's
`c10/cuda/CUDACachingAllocator.cpp` (each test names the functions it follows), and property
tests over random sequences: allocated <= reserved <= capacity, frees coalesce, empty_cache
gives back exactly the unsplit segments, and everything freed leaves whole segments.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from autotune.core.memory.allocator import (
    NO_BLOCK,
    AllocatorOutOfMemory,
    BlockId,
    BlockInfo,
    CachingAllocator,
)
from autotune.core.memory.allocator_blocks import round_size
from autotune.core.memory.allocator_config import MIB, AllocatorConfig, parse_alloc_conf
from tests.autotune_tests.core.memory.allocator_checks import check_all, releasable_bytes

GIB = 1024 * MIB


def layout(allocator: CachingAllocator) -> list[list[tuple[int, bool]]]:
    """Each segment as [(block MiB, allocated), ...], in address order."""
    return [
        [(b.size_bytes / MIB, b.allocated) for b in segment.blocks]
        for segment in allocator.snapshot()
    ]


def test_the_model_loads_no_torch() -> None:
    """The core is torch-free: the server and the bench can use the model without torch."""
    code = (
        "import sys, autotune.core.memory.allocation_trace, autotune.core.memory.allocator; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# -- rounding and the two pools (round_size, get_pool, get_allocation_size, should_split) -------


def test_a_small_request_rounds_to_512_bytes_and_gets_a_2mib_segment() -> None:
    allocator = CachingAllocator(GIB)
    allocator.malloc(1)
    stats = allocator.stats
    assert (stats.allocated_bytes, stats.requested_bytes) == (512, 1)
    assert stats.reserved_bytes == 2 * MIB
    # should_split, small pool: the remainder (>= kMinBlockSize) stays a free block.
    assert allocator.snapshot()[0].blocks == (
        BlockInfo(512, 1, True),
        BlockInfo(2 * MIB - 512, 0, False),
    )


def test_small_requests_pack_into_one_2mib_segment_until_it_is_full() -> None:
    allocator = CachingAllocator(GIB)
    for _ in range(4):
        allocator.malloc(512 * 1024)
    assert layout(allocator) == [[(0.5, True)] * 4]  # the last one leaves nothing to split
    allocator.malloc(512 * 1024)
    assert allocator.stats.reserved_bytes == 4 * MIB


def test_one_mib_is_small_and_one_byte_more_is_large() -> None:
    allocator = CachingAllocator(GIB)
    allocator.malloc(MIB)  # kSmallSize is the largest small request
    allocator.malloc(MIB + 1)
    segments = allocator.snapshot()
    assert [(s.is_small, s.total_bytes) for s in segments] == [(True, 2 * MIB), (False, 20 * MIB)]
    assert segments[1].blocks[0].size_bytes == MIB + 512


def test_requests_under_10mib_share_a_20mib_segment() -> None:
    allocator = CachingAllocator(GIB)
    allocator.malloc(9 * MIB)
    allocator.malloc(9 * MIB)
    allocator.malloc(3 * MIB // 2)
    # The last 2 MiB block is not split for 1.5 MiB (large pool: remaining > kSmallSize only),
    # so the whole block counts as allocated.
    assert layout(allocator) == [[(9, True), (9, True), (2, True)]]
    assert allocator.stats.allocated_bytes == allocator.stats.reserved_bytes == 20 * MIB


def test_requests_of_10mib_and_more_get_their_size_rounded_to_2mib() -> None:
    allocator = CachingAllocator(GIB)
    allocator.malloc(10 * MIB)  # not < kMinLargeAlloc: rounded to kRoundLarge, not 20 MiB
    allocator.malloc(11 * MIB + 1)
    assert [s.total_bytes / MIB for s in allocator.snapshot()] == [10, 12]
    assert layout(allocator)[1] == [(12, True)]  # remainder < 1 MiB: not split


def test_a_large_remainder_of_exactly_1mib_is_not_split() -> None:
    allocator = CachingAllocator(GIB)
    allocator.malloc(19 * MIB)  # segment 20 MiB, remainder 1 MiB: should_split needs > 1 MiB
    assert layout(allocator) == [[(20, True)]]


def test_round_size_divisions() -> None:
    """round_size and roundup_power2_next_division ("1200 with 4 divisions gives 1280")."""
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200, AllocatorConfig()) == 1536
    assert round_size(1200, four) == 1536  # not above kMinBlockSize * divisions: 512-rounded
    assert round_size(84 * MIB, four) == 96 * MIB  # [64, 128) MiB in steps of 16 MiB
    assert round_size(64 * MIB, four) == 64 * MIB  # a power of two stays
    # A division count of 1 rounds nothing (`divisions > 1`; pytorch#161139).
    assert round_size(514 * MIB, parse_alloc_conf("roundup_power2_divisions:[>:1]")) == 514 * MIB


# -- best fit, split and merge (get_free_block, alloc_found_block, free_block) ----------------


def test_best_fit_takes_the_smallest_cached_block_that_fits() -> None:
    allocator = CachingAllocator(GIB)
    blocks = [allocator.malloc(size * MIB) for size in (16, 12, 14)]
    for block in blocks:
        allocator.free(block)
    allocator.malloc(11 * MIB)
    assert layout(allocator) == [[(16, False)], [(12, True)], [(14, False)]]


def test_a_freed_block_merges_with_its_free_neighbours() -> None:
    allocator = CachingAllocator(GIB)
    first, middle, last = (allocator.malloc(6 * MIB) for _ in range(3))
    assert layout(allocator) == [[(6, True), (6, True), (6, True), (2, False)]]
    allocator.free(middle)
    assert layout(allocator) == [[(6, True), (6, False), (6, True), (2, False)]]
    allocator.free(first)
    assert layout(allocator) == [[(12, False), (6, True), (2, False)]]
    allocator.free(last)
    assert layout(allocator) == [[(20, False)]]


def test_empty_cache_returns_unsplit_segments_only() -> None:
    allocator = CachingAllocator(GIB)
    kept = allocator.malloc(6 * MIB)
    allocator.malloc(6 * MIB)
    allocator.free(allocator.malloc(30 * MIB))
    allocator.free(kept)
    allocator.empty_cache()  # release_cached_blocks: the split 20 MiB segment stays
    assert layout(allocator) == [[(6, False), (6, True), (8, False)]]


# -- max_split_size_mb (get_free_block, should_split, release_available_cached_blocks) --------


def test_oversize_blocks_are_not_split_and_serve_only_close_requests() -> None:
    allocator = CachingAllocator(GIB, parse_alloc_conf("max_split_size_mb:40"))
    allocator.free(allocator.malloc(50 * MIB))
    allocator.malloc(30 * MIB)  # < max_split: may not take an oversize block
    assert layout(allocator) == [[(50, False)], [(30, True)]]
    allocator.malloc(45 * MIB)  # oversize, and 50 < 45 + max_non_split_rounding (20): reused
    assert layout(allocator) == [[(50, True)], [(30, True)]]


def test_an_oversize_block_beyond_the_rounding_is_not_reused() -> None:
    allocator = CachingAllocator(GIB, parse_alloc_conf("max_split_size_mb:40"))
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(60 * MIB)  # 100 >= 60 + 20
    assert layout(allocator) == [[(100, False)], [(60, True)]]
    wider = CachingAllocator(
        GIB, parse_alloc_conf("max_split_size_mb:40,max_non_split_rounding_mb:50")
    )
    wider.free(wider.malloc(100 * MIB))
    wider.malloc(60 * MIB)
    assert layout(wider) == [[(100, True)]]


def test_with_max_split_size_one_covering_oversize_segment_is_freed_before_any_retry() -> None:
    allocator = CachingAllocator(160 * MIB, parse_alloc_conf("max_split_size_mb:40"))
    small_block, big_block = allocator.malloc(50 * MIB), allocator.malloc(100 * MIB)
    allocator.free(small_block)
    allocator.free(big_block)
    allocator.malloc(75 * MIB)  # 100 >= 75 + 20: no reuse; no room for 76 MiB more
    # release_available_cached_blocks frees the smallest oversize block >= the request (100),
    # keeps the 50 MiB one, and the allocation succeeds without counting a retry.
    assert layout(allocator) == [[(50, False)], [(76, True)]]
    assert allocator.stats.num_alloc_retries == 0


def test_with_max_split_size_the_largest_oversize_segments_are_freed_until_enough() -> None:
    allocator = CachingAllocator(150 * MIB, parse_alloc_conf("max_split_size_mb:40"))
    kept = allocator.malloc(30 * MIB)
    for block in [allocator.malloc(50 * MIB), allocator.malloc(60 * MIB)]:
        allocator.free(block)
    allocator.free(kept)
    allocator.malloc(70 * MIB)  # no block >= 70: free 60, then 50, from the largest down
    assert layout(allocator) == [[(30, False)], [(70, True)]]
    assert allocator.stats.num_alloc_retries == 0


# -- out of memory: free the cache and retry (malloc, alloc_block, release_cached_blocks) -----


def test_out_of_memory_frees_the_cache_and_retries_once() -> None:
    allocator = CachingAllocator(100 * MIB)
    allocator.free(allocator.malloc(60 * MIB))
    allocator.malloc(70 * MIB)
    stats = allocator.stats
    assert (stats.reserved_bytes, stats.num_alloc_retries, stats.num_ooms) == (70 * MIB, 1, 0)
    assert stats.peak_reserved_bytes == 70 * MIB  # the cache was freed before the new segment


def test_out_of_memory_raises_with_the_figures() -> None:
    allocator = CachingAllocator(100 * MIB)
    allocator.malloc(30 * MIB)
    allocator.malloc(5 * MIB)  # a 20 MiB segment, 15 MiB of it cached
    with pytest.raises(AllocatorOutOfMemory) as raised:
        allocator.malloc(60 * MIB)
    error = raised.value
    assert (error.requested_bytes, error.allocation_bytes) == (60 * MIB, 60 * MIB)
    assert (error.allocated_bytes, error.reserved_bytes) == (35 * MIB, 50 * MIB)
    assert (error.limit_bytes, error.capacity_bytes) == (None, 100 * MIB)
    assert allocator.stats.num_ooms == 1
    assert allocator.stats.num_alloc_retries == 1
    check_all(allocator)


def test_an_exabyte_is_refused_before_the_allocator_runs() -> None:
    """NativeCachingAllocator::allocate refuses >= 1 EB itself: no retry, no num_ooms."""
    allocator = CachingAllocator(GIB)
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(1 << 60)
    assert allocator.stats.num_ooms == allocator.stats.num_alloc_retries == 0


def test_zero_bytes_allocate_nothing_and_bad_frees_are_refused() -> None:
    allocator = CachingAllocator(GIB)
    assert allocator.malloc(0) == NO_BLOCK  # allocate(0) hands out a null pointer
    allocator.free(NO_BLOCK)
    assert allocator.stats.reserved_bytes == 0
    block = allocator.malloc(100)
    allocator.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(BlockId(12345))
    with pytest.raises(ValueError, match="negative"):
        allocator.malloc(-1)


# -- garbage_collection_threshold (garbage_collect_cached_blocks) ------------------------------


def test_garbage_collection_frees_the_oldest_cached_segments_first() -> None:
    # Limit 200 MiB (fraction 0.2 of 1000 MiB), collected above 60 % of it (120 MiB).
    config = parse_alloc_conf("garbage_collection_threshold:0.6,per_process_memory_fraction:0.2")
    allocator = CachingAllocator(1000 * MIB, config)
    older, newer = allocator.malloc(30 * MIB), allocator.malloc(30 * MIB)
    allocator.free(older)  # cached at get_free_block call 2
    allocator.malloc(40 * MIB)  # call 3
    allocator.free(newer)  # cached at call 3
    allocator.malloc(50 * MIB)  # call 4: 100 MiB reserved before it, not above 120: no collection
    allocator.malloc(60 * MIB)  # call 5: 150 > 120, target 30: ages 3 and 2, mean 2.5
    assert layout(allocator) == [[(30, False)], [(40, True)], [(50, True)], [(60, True)]]
    assert allocator.stats.num_alloc_retries == 0


def test_without_garbage_collection_the_retry_frees_every_cached_segment() -> None:
    allocator = CachingAllocator(1000 * MIB, parse_alloc_conf("per_process_memory_fraction:0.2"))
    older, newer = allocator.malloc(30 * MIB), allocator.malloc(30 * MIB)
    allocator.free(older)
    allocator.malloc(40 * MIB)
    allocator.free(newer)
    allocator.malloc(50 * MIB)
    allocator.malloc(60 * MIB)  # 120 + 60 > 200 limit: release_cached_blocks, retry
    assert layout(allocator) == [[(40, True)], [(50, True)], [(60, True)]]
    assert allocator.stats.num_alloc_retries == 1


# -- expandable_segments (try_allocate_expandable_block, map_block, unmap_block) --------------


def test_expandable_segments_grow_by_2mib_pages_for_small_requests() -> None:
    allocator = CachingAllocator(GIB, parse_alloc_conf("expandable_segments:True"))
    allocator.malloc(4096)
    allocator.malloc(MIB)
    stats = allocator.stats
    assert (stats.reserved_bytes, stats.num_segments) == (2 * MIB, 0)  # one page, no cudaMalloc
    allocator.malloc(MIB)  # no room left in the page: the segment grows by a second one
    assert allocator.stats.reserved_bytes == 4 * MIB
    assert [s.is_expandable for s in allocator.snapshot()] == [True]


def test_expandable_segments_grow_by_20mib_pages_for_large_requests() -> None:
    allocator = CachingAllocator(GIB, parse_alloc_conf("expandable_segments:True"))
    first, second = allocator.malloc(12 * MIB), allocator.malloc(12 * MIB)
    # One segment: 12 MiB in the first page, the second 12 MiB across both pages.
    assert layout(allocator) == [[(12, True), (12, True), (16, False)]]
    plain = CachingAllocator(GIB)
    plain.malloc(12 * MIB)
    plain.malloc(12 * MIB)
    assert plain.stats.reserved_bytes == 24 * MIB
    allocator.free(first)
    allocator.empty_cache()  # unmap_block: the page under `first` is still half in use
    assert allocator.stats.reserved_bytes == 40 * MIB
    allocator.free(second)
    allocator.empty_cache()
    assert allocator.stats.reserved_bytes == 0
    assert allocator.snapshot() == ()


def test_expandable_pages_can_run_out_where_exact_segments_fit() -> None:
    expandable = CachingAllocator(30 * MIB, parse_alloc_conf("expandable_segments:True"))
    expandable.malloc(12 * MIB)  # maps one 20 MiB page
    with pytest.raises(AllocatorOutOfMemory):
        expandable.malloc(12 * MIB)  # needs a second page: 40 MiB > 30 MiB
    plain = CachingAllocator(30 * MIB)
    plain.malloc(12 * MIB)
    plain.malloc(12 * MIB)


def test_holes_inside_an_expandable_segment_cost_a_page_where_segments_fit() -> None:
    """The large pool of gpt2-tiny's step at micro-batch 10 (32 tokens, vocabulary 8192) on
    124 MiB, in miniature (docs/design.md#expandable-segments-as-a-knob): the embedding and its
    two Adam states (8 MiB each), its bf16 copy (4), the bf16 logits (5), their fp32 copy and
    log-softmax (10 each), then backward's 10 MiB gradients. In one segment the freed 5 and 10
    MiB leave a 15 MiB hole, which best fit prefers to the tail that could grow
    (`get_free_block`: an expandable block counts as large as it can grow); the next 10 MiB
    finds 5 MiB there and 7 at the tail, and growing maps a whole 20 MiB page
    (`try_allocate_expandable_block`, `map_block`); the retry unmaps only whole free pages
    (`release_blocks`, `unmap_block`), of which there are none. Plain segments serve it from a
    20 MiB segment's free 12 MiB (`get_allocation_size`, `should_split`)."""
    capacity = 68 * MIB  # 8 MiB short of a fourth page; 8 MiB more than the plain step needs
    outcomes: dict[str, int | None] = {}
    for conf in ("", "expandable_segments:True"):
        allocator = CachingAllocator(capacity, parse_alloc_conf(conf))
        for size_mib in (8, 8, 8, 4):  # the residents and the bf16 embedding
            allocator.malloc(size_mib * MIB)
        bf16_logits, logits = allocator.malloc(5 * MIB), allocator.malloc(10 * MIB)
        allocator.malloc(10 * MIB)  # log-softmax, kept for backward
        allocator.free(logits)
        allocator.free(bf16_logits)
        allocator.malloc(10 * MIB)  # the loss's gradient
        try:
            allocator.malloc(10 * MIB)  # log-softmax's backward
        except AllocatorOutOfMemory:
            outcomes[conf] = None
        else:
            outcomes[conf] = allocator.stats.peak_reserved_bytes // MIB
        if conf:
            assert [b for b in layout(allocator)[0] if not b[1]] == [(5, False), (7, False)]
            assert allocator.stats.num_alloc_retries == 1
    assert outcomes == {"": 60, "expandable_segments:True": None}


def test_a_freed_expandable_page_is_mapped_again_before_the_segment_grows() -> None:
    allocator = CachingAllocator(GIB, parse_alloc_conf("expandable_segments:True"))
    blocks = [allocator.malloc(10 * MIB) for _ in range(6)]  # pages 0, 1 and 2
    allocator.free(blocks[2])
    allocator.free(blocks[3])
    allocator.empty_cache()  # page 1 held only blocks 2 and 3: unmapped
    assert allocator.stats.reserved_bytes == 40 * MIB
    assert layout(allocator) == [[(10, True), (10, True)], [(10, True), (10, True)]]
    allocator.malloc(15 * MIB)  # find_expandable_block: the lowest unmapped range with room
    assert allocator.stats.reserved_bytes == 60 * MIB
    assert layout(allocator) == [
        [(10, True), (10, True), (15, True), (5, False), (10, True), (10, True)]
    ]


def test_expandable_blocks_are_skipped_once_expandable_segments_are_turned_off() -> None:
    """get_free_block honours expandable_segments:False for blocks cached before."""
    allocator = CachingAllocator(GIB, parse_alloc_conf("expandable_segments:True"))
    allocator.free(allocator.malloc(12 * MIB))
    allocator.reconfigure(AllocatorConfig())
    allocator.free(allocator.malloc(14 * MIB))  # a new cudaMalloc'd segment, cached
    allocator.malloc(12 * MIB)  # the expandable 40 MiB block comes first; the 14 MiB serves
    assert [(s.is_expandable, s.blocks[0].allocated) for s in allocator.snapshot()] == [
        (True, False),
        (False, True),
    ]
    allocator.malloc(12 * MIB)  # nothing but expandable blocks left: a new segment
    assert allocator.stats.num_segments == 2


# -- property tests -------------------------------------------------------------------------

CONFIGS = [
    "",
    "max_split_size_mb:40",
    "max_split_size_mb:40,max_non_split_rounding_mb:60",
    "expandable_segments:True",
    "roundup_power2_divisions:[1:2,16:4,>:8]",
    "garbage_collection_threshold:0.5,per_process_memory_fraction:0.8",
    "large_segment_size_mb:32,max_split_size_mb:64,expandable_segments:True",
    "garbage_collection_threshold:0.7,max_split_size_mb:20,per_process_memory_fraction:0.9",
]
SIZES = st.one_of(
    st.integers(1, 4096),
    st.integers(4096, MIB + 1024),
    st.integers(MIB, 12 * MIB),
    st.integers(12 * MIB, 80 * MIB),
)
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), SIZES),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("empty"), st.just(0)),
    ),
    min_size=5,
    max_size=120,
)


def run(
    allocator: CachingAllocator,
    operations: list[tuple[str, int]],
    live: list[BlockId] | None = None,
) -> list[BlockId]:
    """Run the operations, checking every invariant after each; return what is still live
    (`live`, what was live before them, updated)."""
    live = [] if live is None else live
    for kind, value in operations:
        if kind == "alloc":
            before = allocator.stats
            try:
                live.append(allocator.malloc(value))
            except AllocatorOutOfMemory:
                assert allocator.stats.num_ooms == before.num_ooms + 1
        elif kind == "free" and live:
            allocator.free(live.pop(value % len(live)))
        elif kind == "empty":
            expected = allocator.stats.reserved_bytes - releasable_bytes(allocator)
            allocator.empty_cache()
            assert allocator.stats.reserved_bytes == expected
            assert releasable_bytes(allocator) == 0
        check_all(allocator)
    return live


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    settings_text=st.sampled_from(CONFIGS),
    capacity_mib=st.integers(40, 400),
    operations=OPERATIONS,
)
def test_any_sequence_keeps_the_invariants_and_frees_to_whole_segments(
    settings_text: str, capacity_mib: int, operations: list[tuple[str, int]]
) -> None:
    allocator = CachingAllocator(capacity_mib * MIB, parse_alloc_conf(settings_text))
    live = run(allocator, operations)
    # Steer the search towards sequences that run out and retry.
    target(float(allocator.stats.num_alloc_retries), label="retries")
    for block in live:
        allocator.free(block)
        check_all(allocator)
    # Everything freed: every segment (every mapped range) is one free block again...
    assert all(len(s.blocks) == 1 and not s.blocks[0].allocated for s in allocator.snapshot())
    # ... so empty_cache gives every byte back.
    allocator.empty_cache()
    assert allocator.stats.reserved_bytes == 0
    assert allocator.snapshot() == ()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    settings_text=st.sampled_from(CONFIGS),
    capacity_mib=st.integers(40, 200),
    operations=OPERATIONS,
)
def test_reserved_never_exceeds_the_capacity_when_the_device_fills_up(
    settings_text: str, capacity_mib: int, operations: list[tuple[str, int]]
) -> None:
    """Every allocation three times over, few frees: the device fills up and runs out."""
    allocator = CachingAllocator(capacity_mib * MIB, parse_alloc_conf(settings_text))
    run(allocator, operations * 3)
    target(float(allocator.stats.num_ooms), label="out of memory")
    assert allocator.stats.peak_reserved_bytes <= capacity_mib * MIB


def _observe(
    allocator: CachingAllocator, live: list[BlockId], operations: list[tuple[str, int]]
) -> list[object]:
    """The blocks live, the figures and the segments after each operation."""
    seen: list[object] = []
    for operation in operations:
        run(allocator, [operation], live)
        seen.append((list(live), allocator.stats, allocator.snapshot()))
    return seen


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    settings_text=st.sampled_from(CONFIGS),
    capacity_mib=st.integers(40, 400),
    before=OPERATIONS,
    after=OPERATIONS,
)
def test_a_clone_and_a_restored_allocator_go_on_as_the_original_and_apart_from_it(
    settings_text: str,
    capacity_mib: int,
    before: list[tuple[str, int]],
    after: list[tuple[str, int]],
) -> None:
    config = parse_alloc_conf(settings_text)
    original = CachingAllocator(capacity_mib * MIB, config)
    live = run(original, before)
    clone = original.clone()
    restored = CachingAllocator(capacity_mib * MIB, config)
    restored.malloc(MIB)  # state of its own, which restore replaces
    restored.restore(original)
    # The clone and the restored allocator run first: had they shared a block, a pool or a
    # segment with the original, its own run would then differ.
    from_clone = _observe(clone, list(live), after)
    from_restored = _observe(restored, list(live), after)
    assert _observe(original, list(live), after) == from_clone == from_restored


def test_an_allocator_is_untouched_until_it_mallocs_or_runs_out() -> None:
    allocator = CachingAllocator(64 * MIB)
    allocator.malloc(0)
    assert allocator.untouched
    allocator.free(allocator.malloc(MIB))
    assert not allocator.untouched
    full = CachingAllocator(64 * MIB)
    with pytest.raises(AllocatorOutOfMemory):
        full.malloc(100 * MIB)
    assert not full.untouched
