"""Invariants of the caching-allocator model, checked against its own snapshot: what
`_check_memory_stat_consistency` in torch's test/test_cuda.py checks against
`torch.cuda.memory_snapshot()`, plus coalescing and the device's limits."""

from __future__ import annotations

from autotune.core.memory.allocator import CachingAllocator, SegmentInfo
from autotune.core.memory.allocator_config import SMALL_BUFFER_BYTES


def page_bytes(allocator: CachingAllocator, segment: SegmentInfo) -> int:
    """The mapping granularity of an expandable segment (find_expandable_block)."""
    return SMALL_BUFFER_BYTES if segment.is_small else allocator.config.large_segment_bytes


def check_stats_match_snapshot(allocator: CachingAllocator) -> None:
    stats = allocator.stats
    segments = allocator.snapshot()
    blocks = [b for s in segments for b in s.blocks]
    assert stats.allocated_bytes == sum(b.size_bytes for b in blocks if b.allocated)
    assert stats.reserved_bytes == sum(s.total_bytes for s in segments)
    assert stats.num_allocations == sum(b.allocated for b in blocks)
    assert stats.num_segments == sum(not s.is_expandable for s in segments)
    assert stats.requested_bytes == sum(b.requested_bytes for b in blocks if b.allocated)


def check_limits(allocator: CachingAllocator) -> None:
    stats = allocator.stats
    assert 0 <= stats.allocated_bytes <= stats.reserved_bytes <= allocator.capacity_bytes
    assert stats.peak_allocated_bytes >= stats.allocated_bytes
    assert stats.peak_reserved_bytes >= stats.reserved_bytes
    if allocator.limit_bytes is not None and not allocator.config.expandable_segments:
        assert stats.reserved_bytes <= allocator.limit_bytes


def check_coalesced(allocator: CachingAllocator) -> None:
    """free_block merges a freed block with its free neighbours: no two free blocks touch."""
    for segment in allocator.snapshot():
        for left, right in zip(segment.blocks, segment.blocks[1:], strict=False):
            assert left.allocated or right.allocated, segment


def releasable_bytes(allocator: CachingAllocator) -> int:
    """What empty_cache must give back: every unsplit cached segment, and every whole free
    page of an expandable segment (a mapped range starts on a page boundary)."""
    total = 0
    for segment in allocator.snapshot():
        if not segment.is_expandable:
            if len(segment.blocks) == 1 and not segment.blocks[0].allocated:
                total += segment.total_bytes
            continue
        page = page_bytes(allocator, segment)
        offset = 0
        for block in segment.blocks:
            if not block.allocated:
                first_page = -(-offset // page)
                end_page = (offset + block.size_bytes) // page
                total += max(end_page - first_page, 0) * page
            offset += block.size_bytes
    return total


def check_all(allocator: CachingAllocator) -> None:
    check_stats_match_snapshot(allocator)
    check_limits(allocator)
    check_coalesced(allocator)
