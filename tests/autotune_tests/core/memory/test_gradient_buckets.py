"""DDP's bucket assignment: hand-built cases that follow compute_bucket_assignment_by_size, and
the same assignment as the installed torch binary's on generated tensor lists."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from autotune.core.memory.gradient_buckets import (
    BROADCAST_LIMITS,
    CONSTRUCTION_LIMITS,
    FIRST_BUCKET_CAP_BYTES,
    REBUILT_LIMITS,
    BucketTensor,
    assign_buckets,
    bucket_bytes,
)

MiB = 2**20
FLOAT = "float32"


def test_constants_are_torchs() -> None:
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == FIRST_BUCKET_CAP_BYTES
    ddp = torch.nn.parallel.distributed
    assert ddp._DEFAULT_BUCKET_CAP_MB * MiB == REBUILT_LIMITS[1]


def test_a_bucket_closes_when_it_reaches_its_limit_then_the_next_limit_applies() -> None:
    tensors = [BucketTensor(n, FLOAT) for n in (MiB // 2, MiB // 2, 10 * MiB, 20 * MiB, 1)]
    buckets = assign_buckets(tensors, REBUILT_LIMITS, ready_order=True)
    # 0.5 + 0.5 MiB reaches the 1 MiB first limit exactly; then 25 MiB: 10 + 20 reaches it.
    assert buckets == [[0, 1], [2, 3], [4]]
    assert bucket_bytes(tensors, buckets) == [MiB, 30 * MiB, 1]


def test_kinds_never_share_a_bucket_and_each_has_its_own_limits() -> None:
    tensors = [
        BucketTensor(2 * MiB, FLOAT),
        BucketTensor(2 * MiB, "float16"),
        BucketTensor(MiB, FLOAT),
        BucketTensor(MiB, "float16"),
    ]
    assert assign_buckets(tensors, REBUILT_LIMITS, ready_order=True) == [[0], [1], [2], [3]]


def test_without_a_limit_one_bucket_per_kind_sorted_by_first_tensor() -> None:
    tensors = [
        BucketTensor(5, "float16"),
        BucketTensor(3 * MiB, FLOAT),
        BucketTensor(7, "float16"),
        BucketTensor(MiB, FLOAT),
    ]
    assert assign_buckets(tensors, CONSTRUCTION_LIMITS, ready_order=False) == [[0, 2], [1, 3]]


def test_refuses_empty_input() -> None:
    with pytest.raises(ValueError):
        assign_buckets([], REBUILT_LIMITS, ready_order=True)
    with pytest.raises(ValueError):
        assign_buckets([BucketTensor(1, FLOAT)], [], ready_order=True)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _random_tensors(rng: random.Random) -> list[torch.Tensor]:
    count = rng.randint(1, 40)
    # Sizes around the limits: tiny, ~1 MiB, ~25 MiB (in elements; meta tensors cost nothing).
    return [
        torch.empty(
            rng.choice((rng.randint(1, 5000), rng.randint(100_000, 400_000), 4_000_000)),
            dtype=rng.choice(DTYPES[: rng.randint(1, 3)]),
            device="meta",
        )
        for _ in range(count)
    ]


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("limits", [CONSTRUCTION_LIMITS, REBUILT_LIMITS, BROADCAST_LIMITS])
def test_matches_the_torch_binary(seed: int, limits: tuple[int, ...]) -> None:
    rng = random.Random(seed)
    tensors = _random_tensors(rng)
    ours = [BucketTensor(t.numel() * t.element_size(), t.dtype) for t in tensors]
    # Sorted by first tensor (construction, broadcast): the order is the binary's too.
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, list(limits))
    assert assign_buckets(ours, limits, ready_order=False) == theirs
    # In ready order (the rebuild) the binary leaves the open buckets in hash-map order: the
    # buckets are the same, their order among kinds is not defined.
    indices = list(range(len(tensors)))
    rng.shuffle(indices)
    in_order = [tensors[i] for i in indices]
    theirs, _ = dist._compute_bucket_assignment_by_size(
        in_order, list(limits), [False] * len(tensors), indices
    )
    ours_ready = assign_buckets([ours[i] for i in indices], limits, ready_order=True)
    assert sorted([indices[p] for p in bucket] for bucket in ours_ready) == sorted(theirs)
    single_kind = len({t.dtype for t in tensors}) == 1
    if single_kind:
        assert [[indices[p] for p in bucket] for bucket in ours_ready] == theirs
