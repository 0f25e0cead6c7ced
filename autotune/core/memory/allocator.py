"""The CUDA caching allocator's policy as a pure model: which segments a sequence of mallocs and
frees reserves on a device of a given size, and when it runs out (torch 2.13,
c10's CUDA `DeviceCachingAllocator`; the design and what is left out:
docs/design.md#the-caching-allocator-model).

Every method names the C++ function it follows. One stream is modelled: a training step runs
on the current stream, and blocks are only reused on the stream that freed them, so a second
stream would only add a pool that this step never draws from. No CUDA events, graphs or private
pools either: they need recordStream or capture, which the step does not use.
"""

from __future__ import annotations

import copy
from bisect import bisect_left
from dataclasses import dataclass
from typing import NewType

from autotune.core.memory.allocator_blocks import (
    Block,
    Pool,
    Segment,
    allocation_size,
    expandable_size,
    round_size,
    splice,
)
from autotune.core.memory.allocator_config import (
    MIN_BLOCK_BYTES,
    SMALL_BUFFER_BYTES,
    SMALL_SIZE_BYTES,
    AllocatorConfig,
)

BlockId = NewType("BlockId", int)
# What malloc(0) returns: torch hands out a null pointer for an empty storage and frees nothing.
NO_BLOCK = BlockId(0)
_ONE_EXABYTE = 1 << 60  # NativeCachingAllocator::allocate refuses this much outright
_UNLIMITED = 1 << 64  # max_split_size's default, SIZE_MAX


class AllocatorOutOfMemory(Exception):
    """The model's out-of-memory (torch raises `torch.OutOfMemoryError` at the same point), with
    the figures torch's message gives.

    Attributes:
        requested_bytes: what the caller asked for.
        allocation_bytes: the segment the allocator tried to add ("Tried to allocate ...").
        allocated_bytes, reserved_bytes: the allocator's figures after freeing its cache.
        limit_bytes: the per-process limit (None when the whole device may be used).
        capacity_bytes: the device's memory.
    """

    def __init__(
        self,
        *,
        requested_bytes: int,
        allocation_bytes: int,
        allocated_bytes: int,
        reserved_bytes: int,
        limit_bytes: int | None,
        capacity_bytes: int,
    ) -> None:
        self.requested_bytes = requested_bytes
        self.allocation_bytes = allocation_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.limit_bytes = limit_bytes
        self.capacity_bytes = capacity_bytes
        limit = "" if limit_bytes is None else f"{limit_bytes} bytes allowed; "
        super().__init__(
            f"out of memory: tried to allocate {allocation_bytes} bytes (for a request of "
            f"{requested_bytes}) on a device of {capacity_bytes} bytes; {limit}{allocated_bytes} "
            f"bytes allocated, {reserved_bytes - allocated_bytes} reserved but unallocated"
        )


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """torch.cuda.memory_stats() figures for the whole device ("all" pools, current and peak).

    `num_segments` counts cudaMalloc'd segments (`segment.all.current`): like torch, it leaves
    out expandable segments, whose pages are counted in `reserved_bytes` only.
    """

    allocated_bytes: int
    reserved_bytes: int
    requested_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_allocations: int
    num_segments: int
    num_alloc_retries: int
    num_ooms: int


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One block of a segment, as `torch.cuda.memory_snapshot()` lists it."""

    size_bytes: int
    requested_bytes: int
    allocated: bool


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One segment (for an expandable segment: one contiguous mapped range), address order."""

    address: int
    total_bytes: int
    is_small: bool
    is_expandable: bool
    blocks: tuple[BlockInfo, ...]

    @property
    def allocated_bytes(self) -> int:
        return sum(b.size_bytes for b in self.blocks if b.allocated)


class CachingAllocator:
    """The caching allocator of one device on which `capacity_bytes` of memory are free.

    `malloc` and `free` follow `DeviceCachingAllocator::malloc` and `::free`; `empty_cache`
    is `emptyCache`. A per-process limit (`per_process_memory_fraction` in the config, or
    `set_memory_fraction`) is checked as torch checks it; the free memory is checked as
    cudaMalloc and cuMemCreate would: `reserved_bytes` never exceeds `capacity_bytes`.

    Args:
        capacity_bytes: the memory the allocator can get from the device.
        config: the allocator settings (torch's defaults when None).
        device_total_bytes: the device's whole memory (`totalGlobalMem`), which a memory
            fraction is a fraction of; the capacity when None (nothing else on the device).
    """

    def __init__(
        self,
        capacity_bytes: int,
        config: AllocatorConfig | None = None,
        *,
        device_total_bytes: int | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.device_total_bytes = device_total_bytes or capacity_bytes
        if self.device_total_bytes < capacity_bytes:
            raise ValueError("the device's total memory is less than the capacity")
        self._config = AllocatorConfig()
        self.reconfigure(config or AllocatorConfig())
        self.limit_bytes: int | None = None
        self.set_memory_fraction(self._config.per_process_memory_fraction)
        self._small = Pool(small=True)
        self._large = Pool(small=False)
        self._live: dict[BlockId, Block] = {}
        self._next_id = 1
        # Segment addresses only order equal-sized blocks; any increasing sequence will do.
        self._next_address = SMALL_BUFFER_BYTES
        self._allocated = self._reserved = self._requested = 0
        self._peak_allocated = self._peak_reserved = 0
        self._num_segments = self._num_alloc_retries = self._num_ooms = 0

    @property
    def config(self) -> AllocatorConfig:
        return self._config

    def reconfigure(self, config: AllocatorConfig) -> None:
        """`torch.cuda.memory._set_allocator_settings`: later decisions use `config`; segments
        already made stay as they are. The memory fraction is read once, at construction
        (`DeviceCachingAllocator`'s constructor); use `set_memory_fraction` to change it."""
        if config.backend != "native":
            raise ValueError(f"only the native allocator is modelled, not {config.backend}")
        self._config = config
        self._max_split = _UNLIMITED if config.max_split_bytes is None else config.max_split_bytes
        # Each request size's rounded size and segment size under `config`: a step asks for
        # the same few hundred sizes tens of thousands of times (a replayed deep model's layers).
        self._sizes: dict[int, tuple[int, int]] = {}

    def set_memory_fraction(self, fraction: float) -> None:
        """`setMemoryFraction`: limit the reserved memory to `fraction` of the device's."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"invalid fraction {fraction}, set it within [0, 1]")
        self.limit_bytes = int(fraction * self.device_total_bytes) if fraction < 1.0 else None

    # -- public operations ------------------------------------------------------------------

    def malloc(self, size_bytes: int) -> BlockId:
        """`DeviceCachingAllocator::malloc`: best fit from the cache, else a new segment, else
        free cached segments and retry.

        Raises:
            AllocatorOutOfMemory: after the retries, with the figures.
        """
        if size_bytes <= 0:
            if size_bytes < 0:
                raise ValueError(f"negative size {size_bytes}")
            return NO_BLOCK
        config = self._config
        sizes = self._sizes.get(size_bytes)
        if sizes is None:
            rounded = round_size(size_bytes, config)
            sizes = self._sizes[size_bytes] = (rounded, allocation_size(rounded, config))
        size, alloc_size = sizes
        if size_bytes >= _ONE_EXABYTE:
            raise self._out_of_memory(size_bytes, alloc_size)
        pool = self._small if size <= SMALL_SIZE_BYTES else self._large
        block = self._get_free_block(pool, size)
        if block is None:
            if self.limit_bytes is not None and config.garbage_collection_threshold > 0.0:
                self._garbage_collect_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size, retry=False)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc_size, retry=False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, size, alloc_size, retry=True)
        if block is None:
            self._num_ooms += 1
            raise self._out_of_memory(size_bytes, alloc_size)
        return self._alloc_found_block(block, pool, size, size_bytes, config.expandable_segments)

    def free(self, block_id: BlockId) -> None:
        """`free` then `free_block`: merge with free neighbours and cache the result."""
        if block_id == NO_BLOCK:
            return
        block = self._live.pop(block_id, None)
        if block is None:
            raise ValueError(f"block {block_id} is not allocated")
        block.allocated = False
        self._allocated -= block.size
        self._requested -= block.requested
        block.requested = 0
        pool = self._small if block.small else self._large
        # Most neighbours are allocated or absent: checked here, before a call.
        neighbour = block.prev
        if neighbour is not None and not neighbour.allocated:
            self._try_merge_blocks(block, neighbour, pool)
        neighbour = block.next
        if neighbour is not None and not neighbour.allocated:
            self._try_merge_blocks(block, neighbour, pool)
        pool.insert(block)

    @property
    def untouched(self) -> bool:
        """Nothing was asked of it yet: its state is a new allocator's of its capacity, device,
        limit and config."""
        return (
            self._next_id == 1
            and self._next_address == SMALL_BUFFER_BYTES
            and self._num_ooms == 0
            and self._num_alloc_retries == 0
        )

    def clone(self) -> CachingAllocator:
        """An independent allocator in this one's state: the same mallocs and frees give both
        the same blocks, ids, segments and figures."""
        twin = copy.copy(self)
        twin._sizes = dict(self._sizes)
        # Every block: the live ones, the cached and unmapped ones, and their neighbours.
        originals: dict[int, Block] = {}
        pending = [*self._live.values()]
        for pool in (self._small, self._large):
            pending += pool.blocks.values()
            pending += pool.unmapped.values()
        while pending:
            block = pending.pop()
            if id(block) in originals:
                continue
            originals[id(block)] = block
            pending += [n for n in (block.prev, block.next) if n is not None]
        segments: dict[int, Segment] = {}
        twins: dict[int, Block] = {}
        for key, block in originals.items():
            segment = segments.get(id(block.segment))
            if segment is None:
                segment = Segment(block.segment.base, block.segment.page_bytes)
                segments[id(block.segment)] = segment
            copied = Block(block.address, block.size, block.small, segment, block.mapped)
            copied.requested = block.requested
            copied.allocated = block.allocated
            copied.gc_base = block.gc_base
            twins[key] = copied
        for key, block in originals.items():
            copied = twins[key]
            copied.prev = None if block.prev is None else twins[id(block.prev)]
            copied.next = None if block.next is None else twins[id(block.next)]
        twin._live = {block_id: twins[id(block)] for block_id, block in self._live.items()}
        twin._small = _twin_pool(self._small, twins)
        twin._large = _twin_pool(self._large, twins)
        return twin

    def restore(self, saved: CachingAllocator) -> None:
        """Put this allocator in `saved`'s state (a clone of it: `saved` stays as it is)."""
        self.__dict__.update(saved.clone().__dict__)

    def empty_cache(self) -> None:
        """`emptyCache` (`release_cached_blocks`): return every unsplit cached segment, and
        every free page of the expandable segments, to the device."""
        self._release_cached_blocks()

    def reset_peaks(self) -> None:
        """`resetPeakStats`: the peaks restart from the current figures."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    def reset_accumulated_stats(self) -> None:
        """`resetAccumulatedStats`: the retry and out-of-memory counts restart from 0."""
        self._num_alloc_retries = self._num_ooms = 0

    @property
    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            allocated_bytes=self._allocated,
            reserved_bytes=self._reserved,
            requested_bytes=self._requested,
            peak_allocated_bytes=self._peak_allocated,
            peak_reserved_bytes=self._peak_reserved,
            num_allocations=len(self._live),
            num_segments=self._num_segments,
            num_alloc_retries=self._num_alloc_retries,
            num_ooms=self._num_ooms,
        )

    def snapshot(self) -> tuple[SegmentInfo, ...]:
        """`snapshot`: every segment with its blocks, in address order; an expandable segment
        is reported as one segment per contiguous mapped range, as torch does."""
        blocks = [*self._live.values()]
        for pool in (self._small, self._large):
            blocks += pool.blocks.values()
        heads = sorted(
            (b for b in blocks if b.prev is None or not b.prev.mapped), key=lambda b: b.address
        )
        segments = []
        for head in heads:
            run: list[BlockInfo] = []
            block: Block | None = head
            while block is not None and block.mapped:
                run.append(BlockInfo(block.size, block.requested, block.allocated))
                block = block.next
            total = sum(b.size_bytes for b in run)
            expandable = head.segment.page_bytes > 0
            segments.append(SegmentInfo(head.address, total, head.small, expandable, tuple(run)))
        return tuple(segments)

    # -- finding and making blocks ----------------------------------------------------------

    def _get_free_block(self, pool: Pool, size: int) -> Block | None:
        """`get_free_block`: the smallest cached block that fits, unless it is oversize."""
        if self.limit_bytes is not None and self._config.garbage_collection_threshold > 0.0:
            pool.free_block_calls += 1
        keys = pool.keys
        index = bisect_left(keys, (size, 0))
        if index == len(keys):
            return None
        block = pool.at(index)
        if block.segment.page_bytes:
            if self._config.expandable_segments:
                # A block that can grow into the unmapped space after it counts as that large,
                # so a block that cannot grow as much is preferred.
                while block.segment.page_bytes and index + 1 < len(keys):
                    following = pool.at(index + 1)
                    if expandable_size(following) >= expandable_size(block):
                        break
                    index += 1
                    block = following
            else:
                # Expandable segments were turned off: only ordinary blocks may serve.
                index += 1
                while index < len(keys) and pool.at(index).segment.page_bytes:
                    index += 1
                if index == len(keys):
                    return None
                block = pool.at(index)
        max_split = self._max_split
        if size < max_split and block.size >= max_split:
            return None  # an oversize block is not split for a smaller request
        if size >= max_split and block.size >= size + self._config.max_non_split_rounding_bytes:
            return None  # an oversize block serves oversize requests only within the rounding
        pool.remove(block)
        return block

    def _alloc_block(self, pool: Pool, size: int, alloc_size: int, retry: bool) -> Block | None:
        """`alloc_block`: a new segment of `alloc_size`, or pages of an expandable segment."""
        if retry:
            self._num_alloc_retries += 1
        if self.limit_bytes is not None and self._reserved + alloc_size > self.limit_bytes:
            return None
        if self._config.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        if self._reserved + alloc_size > self.capacity_bytes:
            return None  # cudaMalloc fails
        segment = Segment(self._take_address(alloc_size), page_bytes=0)
        block = Block(segment.base, alloc_size, pool.small, segment)
        self._num_segments += 1
        self._reserve(alloc_size)
        return block

    def _alloc_found_block(
        self, block: Block, pool: Pool, size: int, size_bytes: int, expandable: bool
    ) -> BlockId:
        """`should_split` then `alloc_found_block`: split off the remainder when it is worth
        keeping, and hand out the block."""
        remaining = block.size - size
        if pool.small or expandable:
            split = remaining >= MIN_BLOCK_BYTES
        else:
            split = size < self._max_split and remaining > SMALL_SIZE_BYTES
        if split:
            rest = block
            block = Block(rest.address, size, rest.small, rest.segment)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = rest
            rest.prev = block
            rest.address += size
            rest.size -= size
            pool.insert(rest)
        block.allocated = True
        block.requested = size_bytes
        self._allocated += block.size
        self._requested += size_bytes
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        block_id = BlockId(self._next_id)
        self._next_id += 1
        self._live[block_id] = block
        return block_id

    def _try_merge_blocks(self, dst: Block, src: Block | None, pool: Pool) -> int:
        """`try_merge_blocks`: `dst` absorbs its free neighbour `src` of the same mapping."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.address = src.address
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- giving memory back -----------------------------------------------------------------

    def _release_block(self, block: Block, pool: Pool) -> None:
        """`release_block`: cudaFree an unsplit cached segment."""
        pool.remove(block)
        self._reserved -= block.size
        self._num_segments -= 1

    def _release_available_cached_blocks(self, pool: Pool, size: int) -> bool:
        """`release_available_cached_blocks`: with max_split_size set, free the smallest
        oversize cached segment that covers the request, else the largest ones until they do."""
        if self._config.max_split_bytes is None:
            return False
        target = max(size, self._max_split)
        keys = pool.keys
        index = bisect_left(keys, (target, 0))
        if index < len(keys) and not pool.at(index).segment.page_bytes:
            self._release_block(pool.at(index), pool)
            return True
        if index == 0:
            return False
        released = 0
        index -= 1
        while released < target and pool.at(index).size >= self._max_split:
            current = pool.at(index)
            is_first = index == 0
            if not is_first:
                index -= 1
            if not current.segment.page_bytes:
                released += current.size
                self._release_block(current, pool)
            if is_first:
                break
        return released >= target

    def _release_cached_blocks(self) -> None:
        """`release_cached_blocks` (`release_blocks` on each pool): free every unsplit cached
        segment and unmap every whole free page of an expandable segment."""
        for pool in (self._large, self._small):
            to_unmap = []
            for block in [*pool.blocks.values()]:
                if block.segment.page_bytes:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(block, pool)
            for block in to_unmap:
                self._unmap_block(block, pool)
                if not block.is_split() and not block.mapped:
                    pool.remove_unmapped(block)  # release_expandable_segment

    def _garbage_collect_cached_blocks(self) -> None:
        """`garbage_collect_cached_blocks`: above `threshold x limit` reserved, free unsplit
        cached large segments, those unused for longer than the average first."""
        assert self.limit_bytes is not None
        threshold = int(self._config.garbage_collection_threshold * self.limit_bytes)
        if self._reserved <= threshold:
            return
        target = self._reserved - threshold
        pool = self._large
        clock = pool.free_block_calls
        freeable = [b for b in pool.blocks.values() if not b.is_split()]
        total_age = sum(clock - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for block in [pool.at(index) for index in range(len(pool.keys))]:
                age = clock - block.gc_base
                if not block.is_split() and not block.segment.page_bytes and age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block, pool)

    # -- expandable segments ----------------------------------------------------------------

    def _try_allocate_expandable_block(self, pool: Pool, size: int) -> Block | None:
        """`try_allocate_expandable_block`: map pages at the lowest address with room."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(
            candidate, min(candidate.size, size), pool
        ):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None and not following.mapped
            if not self._map_block(following, min(size - candidate.size, following.size), pool):
                return None
            candidate = following  # it absorbed the mapped block before it
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: Pool, size: int) -> Block:
        """`find_expandable_block`: the lowest unmapped range (with a free block just before
        it) that has `size` bytes of room, else a new segment's whole address space."""
        for address in pool.unmapped_addresses:
            candidate = pool.unmapped[address]
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            room = 0
            block: Block | None = candidate
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return candidate
        page = SMALL_BUFFER_BYTES if pool.small else self._config.large_segment_bytes
        # Address space for 1 1/8 of the device's memory (ExpandableSegment's constructor).
        total = self.device_total_bytes + self.device_total_bytes // 8
        space = -(-total // page) * page
        segment = Segment(self._take_address(space), page_bytes=page)
        candidate = Block(segment.base, space, pool.small, segment, mapped=False)
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, block: Block, size: int, pool: Pool) -> bool:
        """`map_block`: back the first `size` bytes of an unmapped range with whole pages."""
        page = block.segment.page_bytes
        offset = block.address - block.segment.base
        mapped = (-(-(offset + size) // page) - offset // page) * page
        if mapped == 0 or self._reserved + mapped > self.capacity_bytes:
            return False  # cuMemCreate runs out: nothing of this call stays mapped
        pool.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(
                block.address + mapped, block.size - mapped, block.small, block.segment, False
            )
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.insert_unmapped(rest)
            block.size = mapped
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert(block)
        self._reserve(mapped)
        return True

    def _unmap_block(self, block: Block, pool: Pool) -> None:
        """`unmap_block`: give back the whole pages inside a free block; the partial pages at
        its ends stay mapped as free blocks of their own."""
        page = block.segment.page_bytes
        offset = block.address - block.segment.base
        first_page = -(-offset // page)
        end_page = (offset + block.size) // page
        if first_page >= end_page:
            return
        pool.remove(block)
        start = block.segment.base + first_page * page
        unmapped = (end_page - first_page) * page
        if start > block.address:
            before = Block(block.address, start - block.address, block.small, block.segment)
            splice(before, block.prev, block)
            pool.insert(before)
        after_bytes = block.address + block.size - (start + unmapped)
        if after_bytes > 0:
            after = Block(start + unmapped, after_bytes, block.small, block.segment)
            splice(after, block, block.next)
            pool.insert(after)
        block.address = start
        block.size = unmapped
        block.mapped = False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        self._reserved -= unmapped

    # -- bookkeeping ------------------------------------------------------------------------

    def _out_of_memory(self, size_bytes: int, alloc_size: int) -> AllocatorOutOfMemory:
        return AllocatorOutOfMemory(
            requested_bytes=size_bytes,
            allocation_bytes=alloc_size,
            allocated_bytes=self._allocated,
            reserved_bytes=self._reserved,
            limit_bytes=self.limit_bytes,
            capacity_bytes=self.capacity_bytes,
        )

    def _take_address(self, size: int) -> int:
        address = self._next_address
        self._next_address += -(-size // SMALL_BUFFER_BYTES) * SMALL_BUFFER_BYTES
        return address

    def _reserve(self, size: int) -> None:
        self._reserved += size
        self._peak_reserved = max(self._peak_reserved, self._reserved)


def _twin_pool(pool: Pool, twins: dict[int, Block]) -> Pool:
    """`pool` with each block replaced by its twin (`CachingAllocator.clone`)."""
    twin = Pool(pool.small)
    twin.keys = list(pool.keys)
    twin.blocks = {address: twins[id(block)] for address, block in pool.blocks.items()}
    twin.unmapped_addresses = list(pool.unmapped_addresses)
    twin.unmapped = {address: twins[id(block)] for address, block in pool.unmapped.items()}
    twin.free_block_calls = pool.free_block_calls
    return twin
