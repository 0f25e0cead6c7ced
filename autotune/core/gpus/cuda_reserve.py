"""What CUDA takes on a named GPU besides the step's tensors, where it sits, and the capacity a
training process really gets: `budget_for(gpu, world_size)`.

Torch-free. Outside the caching allocator: the CUDA context (lazily loaded kernels) and, with
world_size > 1, NCCL's buffers; they come off the card's total. Inside it: the cuBLAS and
cuBLASLt workspaces torch allocates through the allocator and keeps for the process's life; they
are resident in every step, so the emulated device counts them as live tensors. Figures,
sources and uncertainty: docs/design.md#named-gpus-and-what-cuda-takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.core.gpus.catalogue import Gpu
from autotune.core.memory.kernel_scratch import CONV_WORKSPACE_REASON
from autotune.core.schemas import CudaReserve

_KiB = 2**10
_MiB = 2**20

# The CUDA context with lazy module loading (CUDA >= 11.7; torch sets CUDA_MODULE_LOADING=LAZY
# when unset): a part that does not depend on the card, calibrated on bare contexts (A100
# 424 MiB, RTX 6000 Ada 426 MiB, less their local memory below), plus the kernels one training
# step loads (an A100 running a model held 503 MiB outside torch).
CONTEXT_FIXED_BYTES = 208 * _MiB
STEP_KERNELS_BYTES = 96 * _MiB
# The driver backs every resident thread's stack when the context is made:
# cudaLimitStackSize defaults to 1 KiB per thread.
STACK_BYTES_PER_THREAD = 1 * _KiB
CONTEXT_UNCERTAINTY_BYTES = 100 * _MiB

# torch's cuBLAS handle pool with CUBLAS_WORKSPACE_CONFIG and
# CUBLASLT_WORKSPACE_SIZE unset: ":4096:2:16:8" (8 MiB + 128 KiB), 32 MiB on sm_90; cuBLASLt
# 1 MiB.
CUBLAS_WORKSPACE_BYTES = 4096 * _KiB * 2 + 16 * _KiB * 8
CUBLAS_WORKSPACE_SM90_BYTES = 4096 * 8 * _KiB
CUBLASLT_WORKSPACE_BYTES = 1024 * _KiB
# One workspace per (handle, stream), a handle per thread: the thread that runs forward and the
# optimizer step, and the autograd engine's device thread that runs backward.
BLAS_THREADS = 2
# The ops whose first run on a thread creates that thread's cuBLAS handle, and with it the
# thread's workspaces.
BLAS_HANDLE_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv"}
)

# NCCL (defaults, one communicator): per channel and connection, the Simple buffer
# (NCCL_BUFFSIZE, 4 MiB), the LL128 and LL buffers, 10 MiB once rounded to cuMem's granularity;
# plus its kernels and communicator state. Channels: what NCCL opens over NVLink vs PCIe.
NCCL_BUFFER_BYTES_PER_CONNECTION = 10 * _MiB
NCCL_CONNECTIONS_PER_CHANNEL = 2
NCCL_CHANNELS = {"nvlink": 16, "pcie": 4}
NCCL_FIXED_BYTES = 228 * _MiB


@dataclass(frozen=True)
class GpuBudget:
    """A named GPU as one training process (one rank) sees it.

    `capacity_bytes` is what the caching allocator can get: the card's total less what CUDA
    takes outside it. The step's tensors and the resident BLAS workspaces must fit in it, and
    `reserve.kernel_workspace_bytes` is kept free below it.
    """

    gpu: Gpu
    world_size: int
    reserve: CudaReserve
    blas_workspace_sizes: tuple[int, ...]  # one by one, as the allocator holds them
    assumptions: tuple[str, ...]

    @property
    def capacity_bytes(self) -> int:
        return self.gpu.total_memory_bytes - self.reserve.outside_allocator_bytes


def context_bytes(gpu: Gpu) -> int:
    """The CUDA context once a training step has run: its fixed part, the step's kernels, and
    the stacks of every thread the card can hold."""
    stacks_bytes = gpu.sm_count * gpu.max_threads_per_sm * STACK_BYTES_PER_THREAD
    return CONTEXT_FIXED_BYTES + STEP_KERNELS_BYTES + stacks_bytes


def nccl_bytes(gpu: Gpu, world_size: int) -> int:
    """NCCL's memory per rank for one data-parallel communicator; 0 for one rank."""
    if world_size <= 1:
        return 0
    channels = NCCL_CHANNELS[gpu.interconnect]
    buffers_bytes = channels * NCCL_CONNECTIONS_PER_CHANNEL * NCCL_BUFFER_BYTES_PER_CONNECTION
    return NCCL_FIXED_BYTES + buffers_bytes


def _mib(size_bytes: int) -> str:
    mib = size_bytes / _MiB
    return f"{mib:,.3f} MiB" if mib < 100 and mib != round(mib) else f"{mib:,.0f} MiB"


def budget_for(gpu: Gpu, world_size: int = 1) -> GpuBudget:
    """The capacity one rank of `world_size` gets on `gpu`, what CUDA takes, and why."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    sm90 = gpu.compute_capability == (9, 0)
    cublas_bytes = CUBLAS_WORKSPACE_SM90_BYTES if sm90 else CUBLAS_WORKSPACE_BYTES
    workspaces = (cublas_bytes, CUBLASLT_WORKSPACE_BYTES) * BLAS_THREADS
    reserve = CudaReserve(
        context_bytes=context_bytes(gpu),
        nccl_bytes=nccl_bytes(gpu, world_size),
        blas_workspace_bytes=sum(workspaces),
    )
    channels = NCCL_CHANNELS[gpu.interconnect]
    nccl = (
        f"NCCL {_mib(reserve.nccl_bytes)} outside the allocator for world_size {world_size}: "
        f"{channels} channels x {NCCL_CONNECTIONS_PER_CHANNEL} connections x "
        f"{_mib(NCCL_BUFFER_BYTES_PER_CONNECTION)} ({gpu.interconnect}, NCCL defaults, one "
        f"communicator, one node) + {_mib(NCCL_FIXED_BYTES)} kernels and state"
        if world_size > 1
        else "no NCCL buffers: world_size 1"
    )
    assumptions = (
        f"{gpu.name} ({gpu.nvidia_smi_name}): {_mib(gpu.total_memory_bytes)} total as CUDA "
        "reports it; the driver changes it by up to ~0.5%",
        f"CUDA context {_mib(reserve.context_bytes)} (+-{_mib(CONTEXT_UNCERTAINTY_BYTES)}) "
        "outside the allocator: lazy module loading (CUDA >= 11.7, torch's default), "
        f"{gpu.sm_count} SMs x {gpu.max_threads_per_sm} threads x 1 KiB stacks",
        f"cuBLAS {_mib(cublas_bytes)} + cuBLASLt {_mib(CUBLASLT_WORKSPACE_BYTES)} workspaces "
        f"x {BLAS_THREADS} threads (forward, autograd) resident inside the allocator: torch "
        "2.13 defaults, CUBLAS_WORKSPACE_CONFIG unset",
        nccl,
        CONV_WORKSPACE_REASON,
        "fused attention's backward scratch (flash: softmax_d and the fp32 dq accumulator) "
        "counted inside the op that allocates it; compute capability 8.0 or newer assumed "
        "for the flash kernel",
        "the whole card for this process: no other process, no MIG slice, no display",
    )
    return GpuBudget(
        gpu=gpu,
        world_size=world_size,
        reserve=reserve,
        blas_workspace_sizes=workspaces,
        assumptions=assumptions,
    )
