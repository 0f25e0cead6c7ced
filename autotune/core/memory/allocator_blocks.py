"""The caching allocator's bookkeeping: segments, the blocks they are split into, the pools
that keep free blocks in best-fit order, and the sizes requests are rounded to (torch 2.13's
CUDA caching allocator; docs/design.md#the-caching-allocator-model).
"""

from __future__ import annotations

from bisect import bisect_left, insort

from autotune.core.memory.allocator_config import (
    MIN_BLOCK_BYTES,
    MIN_LARGE_ALLOC_BYTES,
    ROUND_LARGE_BYTES,
    SMALL_BUFFER_BYTES,
    SMALL_SIZE_BYTES,
    AllocatorConfig,
)


class Segment:
    """A cudaMalloc'd segment (`page_bytes` 0) or an expandable segment's address space."""

    __slots__ = ("base", "page_bytes")

    def __init__(self, base: int, page_bytes: int) -> None:
        self.base = base
        self.page_bytes = page_bytes


class Block:
    """`Block`: a range of a segment, free or allocated, linked to its neighbours."""

    __slots__ = (
        "address",
        "size",
        "requested",
        "small",
        "allocated",
        "mapped",
        "prev",
        "next",
        "segment",
        "gc_base",
    )

    def __init__(
        self, address: int, size: int, small: bool, segment: Segment, mapped: bool = True
    ) -> None:
        self.address = address
        self.size = size
        self.requested = 0
        self.small = small
        self.allocated = False
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None
        self.segment = segment
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class Pool:
    """`BlockPool`: free blocks ordered by (size, address) for best fit, and an expandable
    segment's unmapped ranges ordered by address (one stream, so no stream in the keys)."""

    __slots__ = ("small", "keys", "blocks", "unmapped_addresses", "unmapped", "free_block_calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, Block] = {}
        self.unmapped_addresses: list[int] = []
        self.unmapped: dict[int, Block] = {}
        # get_free_blocks_call_count: the clock that ages cached blocks for garbage collection.
        self.free_block_calls = 0

    def insert(self, block: Block) -> None:
        """`insert_into_blocks`: also stamps the block's age."""
        insort(self.keys, (block.size, block.address))
        self.blocks[block.address] = block
        block.gc_base = self.free_block_calls

    def remove(self, block: Block) -> None:
        del self.keys[bisect_left(self.keys, (block.size, block.address))]
        del self.blocks[block.address]

    def at(self, index: int) -> Block:
        return self.blocks[self.keys[index][1]]

    def insert_unmapped(self, block: Block) -> None:
        insort(self.unmapped_addresses, block.address)
        self.unmapped[block.address] = block

    def remove_unmapped(self, block: Block) -> None:
        del self.unmapped_addresses[bisect_left(self.unmapped_addresses, block.address)]
        del self.unmapped[block.address]


def round_size(size_bytes: int, config: AllocatorConfig) -> int:
    """`round_size`: 512-byte blocks, or a power-of-two division when configured. A division
    count of 1 rounds nothing (the C++ tests `divisions > 1`; pytorch#161139)."""
    if size_bytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    divisions = config.divisions_for(size_bytes)
    if divisions > 1 and size_bytes > MIN_BLOCK_BYTES * divisions:
        return roundup_power2_next_division(size_bytes, divisions)
    return -(-size_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def roundup_power2_next_division(size_bytes: int, divisions: int) -> int:
    """`roundup_power2_next_division`: 1200 with 4 divisions of [1024, 2048) gives 1280."""
    if size_bytes & (size_bytes - 1) == 0:
        return size_bytes
    floor = 1 << (size_bytes.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded_down = size_bytes & ~(step - 1)
    return size_bytes if rounded_down == size_bytes else rounded_down + step


def allocation_size(size_bytes: int, config: AllocatorConfig) -> int:
    """`get_allocation_size`: the segment a request that finds no cached block makes."""
    if size_bytes <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size_bytes < MIN_LARGE_ALLOC_BYTES:
        return config.large_segment_bytes
    return -(-size_bytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def expandable_size(block: Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


def splice(block: Block, before: Block | None, after: Block | None) -> None:
    """`Block::splice`: link `block` between two neighbours."""
    if before is not None:
        before.next = block
    block.prev = before
    if after is not None:
        after.prev = block
    block.next = after
