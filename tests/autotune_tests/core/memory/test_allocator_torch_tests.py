"""PyTorch's own caching-allocator tests, re-stated as tests of the model: their numbers, our
code (docs/design.md#the-caching-allocator-model).

From test/test_cuda.py: `_test_memory_stats_generator` with `_check_memory_stat_consistency`
(the memory-statistics test), `test_memory_stats`, `test_set_per_process_memory_fraction`,
`test_out_of_memory_retry`, `test_allocator_settings` (its round-up-division checks),
`test_max_split_expandable`, `test_garbage_collect_expandable`, `test_raises_oom` and
`test_allocator_fuzz`. c10's `AllocatorConfig_test` is re-stated in test_allocator_config.py.
A tensor of n float32 elements is a malloc of 4n bytes.
"""

from __future__ import annotations

import random

import pytest

from autotune.core.memory.allocator import (
    NO_BLOCK,
    AllocatorOutOfMemory,
    BlockId,
    CachingAllocator,
)
from autotune.core.memory.allocator_config import MIB, AllocatorConfigError, parse_alloc_conf
from tests.autotune_tests.core.memory.allocator_checks import check_all

GIB = 1024 * MIB
FLOAT32_BYTES = 4


def floats(allocator: CachingAllocator, *shape: int) -> BlockId:
    numel = 1
    for extent in shape:
        numel *= extent
    return allocator.malloc(numel * FLOAT32_BYTES)


def test_memory_stats_generator() -> None:
    """`_test_memory_stats_generator` (N=35): allocated moves with every allocation and free,
    the peaks bound the currents, empty_cache keeps the peak, reset restarts it; and after every
    step the statistics agree with the snapshot (`_check_memory_stat_consistency`)."""
    allocator = CachingAllocator(8 * GIB)
    last = allocator.stats

    def assert_change(comp: int, empty_cache: bool = False, reset_peak: bool = False) -> None:
        nonlocal last
        new = allocator.stats
        if comp > 0:
            assert new.allocated_bytes > last.allocated_bytes
        elif comp < 0:
            assert new.allocated_bytes < last.allocated_bytes
        else:
            assert new.allocated_bytes == last.allocated_bytes
        assert new.allocated_bytes <= new.peak_allocated_bytes
        assert new.peak_allocated_bytes >= last.peak_allocated_bytes
        assert new.reserved_bytes <= new.peak_reserved_bytes
        assert new.peak_reserved_bytes >= last.peak_reserved_bytes
        if empty_cache:
            allocator.empty_cache()
            emptied = allocator.stats
            assert emptied.reserved_bytes <= new.reserved_bytes
            assert emptied.peak_reserved_bytes == new.peak_reserved_bytes
            new = emptied
        if reset_peak:
            allocator.reset_peaks()
            new = allocator.stats
            assert new.peak_allocated_bytes == new.allocated_bytes
            assert new.peak_reserved_bytes == new.reserved_bytes
        check_all(allocator)
        last = new

    n = 35
    m0 = allocator.stats.allocated_bytes
    assert_change(0)
    assert_change(0, reset_peak=True)
    assert_change(0, empty_cache=True)
    tensors1 = [floats(allocator, 1), floats(allocator, 10, 20), floats(allocator, 200, 300, 2000)]
    m1 = allocator.stats.allocated_bytes
    assert_change(1)
    tensors2 = []
    for i in range(1, n // 2 + 1):  # small ones
        tensors2.append(floats(allocator, i, i * 4))
        assert_change(1)
    for i in range(5, n // 2 + 5):  # large ones
        tensors2.append(floats(allocator, i, i * 7, i * 9, i * 11))
        assert_change(1, reset_peak=(i % 2 == 0))
    tensors2.append(floats(allocator, 0, 0, 0))
    assert_change(0)
    random.Random(0).shuffle(tensors2)  # torch.randperm
    assert_change(0, reset_peak=True)
    for i in range(n // 2):
        empty = tensors2[i] == NO_BLOCK
        allocator.free(tensors2.pop(i))
        assert_change(0 if empty else -1)
    for i in range(2, 2 * n // 3 + 2):
        tensors2.append(floats(allocator, i, i * 3, i * 8))
        assert_change(1)
    for block in tensors2:
        allocator.free(block)
    assert_change(-1, reset_peak=True)
    assert allocator.stats.allocated_bytes == m1
    for block in tensors1:
        allocator.free(block)
    assert_change(-1, reset_peak=True)
    assert allocator.stats.allocated_bytes == m0
    assert_change(0, empty_cache=True)
    assert allocator.stats.reserved_bytes == 0


def test_memory_stats() -> None:
    """`test_memory_stats`: randn(256) makes 1 kB active; freeing it and emptying the cache
    brings everything back; resetting the peaks brings them back too."""
    allocator = CachingAllocator(GIB)
    allocator.reset_peaks()
    before = allocator.stats
    tmp = floats(allocator, 256)
    assert allocator.stats.allocated_bytes == before.allocated_bytes + 1024
    allocator.free(tmp)
    allocator.empty_cache()
    assert allocator.stats.allocated_bytes == before.allocated_bytes
    allocator.reset_peaks()
    after = allocator.stats
    assert after.peak_allocated_bytes == before.peak_allocated_bytes
    assert after.peak_reserved_bytes == before.peak_reserved_bytes


# A 16 GiB card of which the CUDA context and kernels take 500 MiB.
CARD_TOTAL_BYTES = 16 * GIB
CARD_FREE_BYTES = CARD_TOTAL_BYTES - 500 * MIB


def test_set_per_process_memory_fraction() -> None:
    """`test_set_per_process_memory_fraction`: with half the card allowed, 0.499 of it (less
    what is reserved) fits and 0.5 of it does not."""
    allocator = CachingAllocator(CARD_FREE_BYTES, device_total_bytes=CARD_TOTAL_BYTES)
    for invalid in (-0.1, 2.0):
        with pytest.raises(ValueError, match="invalid fraction"):
            allocator.set_memory_fraction(invalid)
    floats(allocator, 1024)  # torch.zeros(1024): its 2 MiB segment stays reserved
    allocator.empty_cache()
    allocator.set_memory_fraction(0.5)
    application = int(CARD_TOTAL_BYTES * 0.499) - allocator.stats.peak_reserved_bytes
    allocator.free(allocator.malloc(application))
    allocator.empty_cache()
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(int(CARD_TOTAL_BYTES * 0.5))


def test_out_of_memory_retry() -> None:
    """`test_out_of_memory_retry`: half the card twice does not fit; after freeing the first
    half, the second does."""
    allocator = CachingAllocator(CARD_FREE_BYTES, device_total_bytes=CARD_TOTAL_BYTES)
    size = int(CARD_TOTAL_BYTES * 0.5)
    first = allocator.malloc(size)
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(size)
    allocator.free(first)
    allocator.malloc(size)


def test_allocator_settings_round_up_divisions() -> None:
    """`test_allocator_settings`: 21 Mi floats (84 MiB) and 100 Mi floats (400 MiB) under each
    setting; each new block is the size the test expects (its `power2_div`)."""
    allocator = CachingAllocator(4 * GIB)
    nbytes = 21 * MIB * FLOAT32_BYTES
    nbytes_big = 100 * MIB * FLOAT32_BYTES

    def block_bytes(settings: str, size: int) -> int:
        allocator.reconfigure(parse_alloc_conf(settings))
        before = allocator.stats
        allocator.malloc(size)
        assert allocator.stats.requested_bytes - before.requested_bytes == size
        return allocator.stats.allocated_bytes - before.allocated_bytes

    assert block_bytes("", nbytes) == nbytes
    assert block_bytes("roundup_power2_divisions:4", nbytes) == 96 * MIB  # power2_div(84 MiB, 4)
    # A new setting string resets the divisions.
    allocator.empty_cache()
    assert block_bytes("garbage_collection_threshold:0.5,max_split_size_mb:40", nbytes) == nbytes
    allocator.empty_cache()
    array = (
        "garbage_collection_threshold:0.5,"
        "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]"
    )
    assert block_bytes(array, nbytes) == 88 * MIB  # power2_div(84 MiB, 8)
    allocator.empty_cache()
    assert block_bytes(array, nbytes_big) == 512 * MIB  # power2_div(400 MiB, 2)
    allocator.empty_cache()
    assert block_bytes("release_lock_on_cudamalloc:True", nbytes) == nbytes
    for invalid in (
        "foo:1,bar:2",
        "garbage_collection_threshold:1.2",
        "max_split_size_mb:2",
        "release_lock_on_cudamalloc:none",
        "pinned_use_cuda_host_register:none",
        "pinned_num_register_threads:none",
        "pinned_num_register_threads:1024",
    ):
        with pytest.raises(AllocatorConfigError):
            parse_alloc_conf(invalid)


def limited_to_120_mib() -> CachingAllocator:
    """A device on which the test's memory fraction leaves exactly 120 MiB."""
    allocator = CachingAllocator(1200 * MIB)
    allocator.set_memory_fraction(0.1)
    assert allocator.limit_bytes == 120 * MIB
    return allocator


def test_max_split_expandable() -> None:
    """`test_max_split_expandable`: 40 MiB plain, 40 MiB expandable, 40 MiB plain fill the
    120 MiB; one more does not fit; freed, the three make room for 120 MiB at once."""
    allocator = limited_to_120_mib()
    plain = parse_alloc_conf("expandable_segments:False,max_split_size_mb:40")
    expandable = parse_alloc_conf("expandable_segments:True,max_split_size_mb:40")
    allocator.reconfigure(plain)
    a = allocator.malloc(40 * MIB)
    allocator.reconfigure(expandable)
    b = allocator.malloc(40 * MIB)
    allocator.reconfigure(plain)
    c = allocator.malloc(40 * MIB)
    with pytest.raises(AllocatorOutOfMemory):
        allocator.malloc(40 * MIB)
    for block in (a, b, c):
        allocator.free(block)
    # release_cached_blocks runs with an expandable segment in the free list.
    allocator.malloc(120 * MIB)
    assert allocator.stats.reserved_bytes == 120 * MIB
    check_all(allocator)


def test_garbage_collect_expandable() -> None:
    """`test_garbage_collect_expandable`: with garbage collection at half of 120 MiB, 80 MiB
    fit after 40 MiB plain and 40 MiB expandable are freed: collection frees the plain one and
    the expandable segment grows."""
    allocator = limited_to_120_mib()
    allocator.reconfigure(
        parse_alloc_conf("expandable_segments:False,garbage_collection_threshold:0.5")
    )
    a = allocator.malloc(40 * MIB)
    allocator.reconfigure(
        parse_alloc_conf("expandable_segments:True,garbage_collection_threshold:0.5")
    )
    b = allocator.malloc(40 * MIB)
    allocator.free(a)
    allocator.free(b)
    allocator.malloc(80 * MIB)
    stats = allocator.stats
    assert (stats.reserved_bytes, stats.num_segments, stats.num_alloc_retries) == (80 * MIB, 0, 0)
    check_all(allocator)


@pytest.mark.parametrize("settings", ["", "max_split_size_mb:1024"])
def test_raises_oom(settings: str) -> None:
    """`test_raises_oom`: 1024^4 floats (4 TiB) run out, with and without max_split_size."""
    allocator = CachingAllocator(80 * GIB, parse_alloc_conf(settings))
    allocator.empty_cache()
    with pytest.raises(AllocatorOutOfMemory):
        floats(allocator, 1024 * 1024 * 1024 * 1024)


@pytest.mark.parametrize(
    "settings",
    [
        "",
        "expandable_segments:True",
        "max_split_size_mb:40",
        "roundup_power2_divisions:[>:4]",
        "garbage_collection_threshold:0.6,per_process_memory_fraction:0.5",
    ],
)
def test_allocator_fuzz(settings: str) -> None:
    """`test_allocator_fuzz` (seed 123, 10000 steps): int32 tensors of 2-20 MiB, frees at
    random and an occasional empty_cache, at most ~100 MB live; the statistics stay consistent
    with the snapshot throughout."""
    rng = random.Random(123)
    allocator = CachingAllocator(GIB, parse_alloc_conf(settings))
    live: list[tuple[BlockId, int]] = []
    total = 0
    for step in range(10_000):
        while total >= 1024 * 1024 * 1024 / (4 * 10):
            block, numel = live.pop(rng.randrange(len(live)))
            allocator.free(block)
            total -= numel
        (action,) = rng.choices(["alloc", "free", "empty"], weights=[1, 1 if live else 0, 0.1])
        if action == "alloc":
            numel = rng.randrange(2 * MIB // 4, 20 * MIB // 4)
            live.append((allocator.malloc(numel * 4), numel))
            total += numel
        elif action == "free":
            block, numel = live.pop(rng.randrange(len(live)))
            allocator.free(block)
            total -= numel
        else:
            allocator.empty_cache()
        if step % 500 == 0:
            check_all(allocator)
    assert allocator.stats.num_ooms == 0
    check_all(allocator)
