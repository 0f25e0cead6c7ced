"""What CUDA takes on a named GPU: the capacity is the card's total less what sits outside the
allocator, for every GPU and world size, and each part follows its stated rule."""

from __future__ import annotations

import pytest

from autotune.core.gpus.catalogue import GPUS, Gpu, find_gpu
from autotune.core.gpus.cuda_reserve import (
    CUBLAS_WORKSPACE_BYTES,
    CUBLAS_WORKSPACE_SM90_BYTES,
    CUBLASLT_WORKSPACE_BYTES,
    budget_for,
    context_bytes,
    nccl_bytes,
)
from autotune.core.schemas import ASSUMPTION_MAX, CudaReserve, DeviceInfo, DeviceKind

MIB = 2**20
KIB = 2**10


@pytest.mark.parametrize("world_size", [1, 2, 8])
@pytest.mark.parametrize("gpu", GPUS, ids=lambda gpu: gpu.name)
def test_capacity_is_the_total_less_what_cuda_takes_outside_the_allocator(
    gpu: Gpu, world_size: int
) -> None:
    budget = budget_for(gpu, world_size)
    reserve = budget.reserve
    assert budget.capacity_bytes == (
        gpu.total_memory_bytes - reserve.context_bytes - reserve.nccl_bytes
    )
    assert reserve.outside_allocator_bytes == reserve.context_bytes + reserve.nccl_bytes
    # The BLAS workspaces are inside the capacity (resident in the allocator), not taken off.
    assert reserve.blas_workspace_bytes == sum(budget.blas_workspace_sizes)
    assert reserve.blas_workspace_bytes < budget.capacity_bytes
    assert reserve.kernel_workspace_bytes == 0
    # What CUDA takes is small next to the card, and a real part of it.
    assert 300 * MIB < reserve.outside_allocator_bytes < 0.1 * gpu.total_memory_bytes
    assert (reserve.nccl_bytes == 0) == (world_size == 1)


def test_the_context_grows_with_the_threads_the_card_holds() -> None:
    # 208 MiB + 96 MiB of kernels + a 1 KiB stack per resident thread.
    assert context_bytes(find_gpu("H100 80GB")) == (208 + 96) * MIB + 132 * 2048 * KIB
    assert context_bytes(find_gpu("A100 80GB")) == (208 + 96) * MIB + 108 * 2048 * KIB
    assert context_bytes(find_gpu("T4")) == (208 + 96) * MIB + 40 * 1024 * KIB
    assert context_bytes(find_gpu("T4")) < context_bytes(find_gpu("H100 80GB"))


def test_blas_workspaces_follow_torch_defaults_two_threads_each() -> None:
    assert CUBLAS_WORKSPACE_BYTES == 8 * MIB + 128 * KIB  # ":4096:2:16:8"
    assert CUBLAS_WORKSPACE_SM90_BYTES == 32 * MIB
    assert CUBLASLT_WORKSPACE_BYTES == 1 * MIB
    hopper = budget_for(find_gpu("H200 141GB"))
    ampere = budget_for(find_gpu("A100 40GB"))
    assert hopper.blas_workspace_sizes == (32 * MIB, MIB, 32 * MIB, MIB)
    assert ampere.blas_workspace_sizes == (8 * MIB + 128 * KIB, MIB) * 2
    # Multiples of 512 B: the allocator's rounding leaves them as they are.
    assert all(size % 512 == 0 for size in hopper.blas_workspace_sizes)


def test_nccl_is_per_rank_and_depends_on_the_interconnect_not_the_rank_count() -> None:
    h100, l4 = find_gpu("H100 80GB"), find_gpu("L4")
    assert nccl_bytes(h100, 1) == 0
    assert nccl_bytes(h100, 2) == nccl_bytes(h100, 64) == (228 + 16 * 2 * 10) * MIB
    assert nccl_bytes(l4, 8) == (228 + 4 * 2 * 10) * MIB
    assert budget_for(h100, 8).capacity_bytes == budget_for(h100).capacity_bytes - 548 * MIB


def test_an_h100_80gb_gives_a_process_about_78_6_gib() -> None:
    budget = budget_for(find_gpu("h100-80gb"))
    assert budget.capacity_bytes == 85045477376 - 568 * MIB
    assert 78.5 < budget.capacity_bytes / 2**30 < 78.7


def test_assumptions_are_short_and_state_every_part() -> None:
    budget = budget_for(find_gpu("H100 80GB"), 8)
    text = " | ".join(budget.assumptions)
    assert all(len(line) <= ASSUMPTION_MAX for line in budget.assumptions)
    needles = ("81,106 MiB", "lazy module loading", "568 MiB", "32 MiB", "world_size 8", "cuDNN")
    for needle in (*needles, "flash"):
        assert needle in text, needle
    assert "no NCCL buffers: world_size 1" in budget_for(find_gpu("T4")).assumptions
    # They fit a DeviceInfo, which is what results carry.
    DeviceInfo(
        kind=DeviceKind.EMULATED,
        name="x",
        total_memory_bytes=1,
        capacity_bytes=1,
        reserve=budget.reserve,
        assumptions=list(budget.assumptions),
    )


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        budget_for(find_gpu("T4"), 0)


def test_the_reserve_record_refuses_negative_parts() -> None:
    with pytest.raises(ValueError):
        CudaReserve(context_bytes=-1, nccl_bytes=0, blas_workspace_bytes=0)
