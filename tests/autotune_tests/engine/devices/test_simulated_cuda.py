"""The simulated CUDA backend against what torch.cuda and NVML do on a card: the context at the
first use, kernels and library handles on first use, the caching allocator's segments and
statistics, out-of-memory, the per-process memory fraction, NVML's memory, MIG and its errors."""

from __future__ import annotations

import pytest
import torch

from autotune.core.errors import DeviceError
from autotune.core.gpus.cuda_reserve import (
    CUBLAS_WORKSPACE_BYTES,
    CUBLAS_WORKSPACE_SM90_BYTES,
    CUBLASLT_WORKSPACE_BYTES,
    STEP_KERNELS_BYTES,
    context_bytes,
)
from autotune.core.memory.allocation_trace import Alloc, Free, replay
from autotune.engine.devices.nvml import read_gpus
from autotune.engine.devices.simulated_cuda import (
    CUBLAS_ALLOC_FAILED,
    CUDNN_INTERNAL_ERROR,
    CUDNN_NOT_SUPPORTED,
    HANDLE_BYTES,
    KERNEL_MODULE_BYTES,
    MigSlice,
    SimulatedCuda,
)
from tests.autotune_tests.engine.simulated_gpus import MiB, small_gpu

BLAS_WORKSPACES = CUBLAS_WORKSPACE_BYTES + CUBLASLT_WORKSPACE_BYTES


def test_the_context_appears_at_the_first_use() -> None:
    gpu = small_gpu()
    with SimulatedCuda(gpu) as cuda:
        assert cuda.outside_allocator_bytes == 0
        free_bytes, total_bytes = cuda.mem_get_info(0)
        assert total_bytes == gpu.total_memory_bytes
        assert cuda.context_bytes == context_bytes(gpu) - STEP_KERNELS_BYTES
        assert free_bytes == total_bytes - cuda.context_bytes
        assert cuda.properties(0).name == gpu.nvidia_smi_name
        assert cuda.torch_device(0) == torch.device("cpu")


def test_kernels_load_at_each_ops_first_run_up_to_a_steps_worth() -> None:
    with SimulatedCuda(small_gpu()) as cuda:
        x = torch.ones(8)
        loaded_bytes = cuda.kernel_bytes
        assert loaded_bytes == KERNEL_MODULE_BYTES  # aten.ones
        x = torch.ones(8) + 1
        assert cuda.kernel_bytes == loaded_bytes + KERNEL_MODULE_BYTES  # aten.add, once
        for op in (torch.sin, torch.cos, torch.exp, torch.tanh, torch.sigmoid, torch.relu):
            x = op(x)
        assert cuda.kernel_bytes == 8 * KERNEL_MODULE_BYTES
        for _ in range(STEP_KERNELS_BYTES // KERNEL_MODULE_BYTES):
            x = x.sqrt().abs().neg().floor().ceil().round().exp2().log1p().expm1().sign()
        # Far more distinct ops than a step runs; loading stops at what a step loads.
        assert cuda.kernel_bytes <= STEP_KERNELS_BYTES


def test_cublas_handles_and_workspaces_appear_at_the_first_matmul_of_each_thread() -> None:
    with SimulatedCuda(small_gpu()) as cuda:
        weight = torch.ones(256, 256, requires_grad=True)
        x = torch.ones(256, 256)
        allocated_bytes = cuda.memory_allocated(0)
        y = x @ weight
        # The output (256 KiB) and the workspaces torch allocates through the allocator.
        assert cuda.memory_allocated(0) == allocated_bytes + y.nbytes + BLAS_WORKSPACES
        assert cuda.handle_bytes == HANDLE_BYTES
        z = x @ weight  # same thread: no new handle
        assert cuda.handle_bytes == HANDLE_BYTES
        z.sum().backward()  # backward runs on the autograd engine's thread: its own handle
        assert cuda.handle_bytes == 2 * HANDLE_BYTES
        del x, y, z, weight
        cuda.empty_cache()
        # Held for the process's life: emptying the cache does not free them.
        assert cuda.memory_allocated(0) == 2 * BLAS_WORKSPACES


def test_hopper_gets_cublas_s_larger_workspace() -> None:
    with SimulatedCuda(small_gpu("H100 80GB")) as cuda:
        torch.ones(4, 4) @ torch.ones(4, 4)
        assert cuda.memory_allocated(0) == CUBLAS_WORKSPACE_SM90_BYTES + CUBLASLT_WORKSPACE_BYTES


def test_segments_and_statistics_are_the_allocator_model_s() -> None:
    sizes = [4000, 4 * MiB, 700 * 1024, 12 * MiB, 100, 3 * MiB]
    with SimulatedCuda(small_gpu()) as cuda:
        cuda.mem_get_info(0)
        tensors = [torch.empty(size, dtype=torch.uint8) for size in sizes]
        # Small requests share a 2 MiB segment; 4 MiB gets a 20 MiB one whose free 16 MiB serve
        # 12 MiB (best fit before a new segment) and then 3 MiB, which takes the last 4 MiB
        # whole: a rest of 1 MiB or less is not split off a large block.
        small_bytes = 4096 + 700 * 1024 + 512
        assert cuda.memory_allocated(0) == small_bytes + 4 * MiB + 12 * MiB + 4 * MiB
        assert cuda.memory_reserved(0) == 2 * MiB + 20 * MiB
        expected = replay([Alloc(size) for size in sizes], 2**40)
        assert cuda.memory_reserved(0) == expected.stats.reserved_bytes
        del tensors[1]
        events = [Alloc(size) for size in sizes] + [Free(1)]
        assert cuda.memory_allocated(0) == replay(events, 2**40).stats.allocated_bytes
        reserved_bytes = cuda.memory_reserved(0)
        cuda.empty_cache()  # the 4 MiB block shares its segment: nothing to return
        assert cuda.memory_reserved(0) == reserved_bytes
        tensors.clear()
        cuda.empty_cache()
        assert (cuda.memory_allocated(0), cuda.memory_reserved(0)) == (0, 0)
        assert cuda.max_memory_reserved(0) == reserved_bytes
        cuda.reset_peak_memory_stats(0)
        assert cuda.max_memory_reserved(0) == 0


def test_a_four_mib_tensor_takes_a_twenty_mib_segment() -> None:
    with SimulatedCuda(small_gpu()) as cuda:
        cuda.mem_get_info(0)
        torch.empty(MiB, dtype=torch.float32)
        assert cuda.max_memory_reserved(0) == 20 * MiB


def test_out_of_memory_is_torch_s_out_of_memory_error() -> None:
    with SimulatedCuda(small_gpu(total_mib=400)) as cuda:
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 200.00 MiB"):
            torch.empty(200 * MiB, dtype=torch.uint8)
        assert cuda.memory_allocated(0) == 0
        free_bytes, _ = cuda.mem_get_info(0)
        kept = torch.empty(free_bytes - 2 * MiB, dtype=torch.uint8)  # fits, with 2 MiB to spare
        assert cuda.memory_reserved(0) == kept.nbytes


def test_the_memory_fraction_frees_the_cache_and_retries_before_running_out() -> None:
    with SimulatedCuda(small_gpu()) as cuda:
        cuda.set_per_process_memory_fraction(50 * MiB / (512 * MiB), 0)
        first = torch.empty(30 * MiB, dtype=torch.uint8)
        del first  # its 30 MiB segment stays cached
        second = torch.empty(40 * MiB, dtype=torch.uint8)  # 70 MiB would pass the limit
        assert cuda.num_alloc_retries(0) == 1
        assert cuda.max_memory_reserved(0) == 40 * MiB
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(20 * MiB, dtype=torch.uint8)
        del second


def test_library_handles_fail_as_cuda_libraries_do_when_memory_is_full() -> None:
    with SimulatedCuda(small_gpu(total_mib=400)) as cuda:
        x = torch.ones(4, 4)
        torch.empty(1, dtype=torch.uint8)  # aten.empty's kernels are loaded from here on
        # The cache takes every free byte: the library's own cudaMalloc has nothing left.
        filler = torch.empty(cuda.free_bytes() - MiB, dtype=torch.uint8)
        assert cuda.free_bytes() == 0
        with pytest.raises(RuntimeError) as cublas:
            x @ x
        assert str(cublas.value) == CUBLAS_ALLOC_FAILED
        with pytest.raises(RuntimeError) as cudnn:
            torch.nn.functional.conv2d(torch.ones(1, 1, 4, 4), torch.ones(1, 1, 3, 3))
        assert str(cudnn.value) == CUDNN_INTERNAL_ERROR
        del filler


def test_cudnn_refuses_a_convolution_past_its_size() -> None:
    with SimulatedCuda(small_gpu(), cudnn_max_elements=1000) as cuda:
        weight = torch.ones(1, 1, 3, 3)
        torch.nn.functional.conv2d(torch.ones(10, 1, 10, 10), weight)  # 1000 elements
        assert cuda.handle_bytes == HANDLE_BYTES  # the cuDNN handle
        with pytest.raises(RuntimeError) as refused:
            torch.nn.functional.conv2d(torch.ones(11, 1, 10, 10), weight)
        assert str(refused.value) == CUDNN_NOT_SUPPORTED


def test_nvml_reports_the_card_with_the_driver_s_reserve_as_used() -> None:
    gpu = small_gpu()
    with SimulatedCuda(gpu, other_processes_bytes=30 * MiB) as cuda:
        held = torch.ones(MiB)
        free_bytes, total_bytes = cuda.mem_get_info(0)
        (card,) = read_gpus(cuda.nvml())
        assert card.uuid == f"GPU-{cuda.properties(0).uuid}"
        assert card.name == gpu.nvidia_smi_name and not card.mig
        assert card.total_memory_bytes == gpu.nvidia_smi_total_bytes
        # NVML's v1 memory info: used + free = total, the driver's reserve in used.
        assert card.total_memory_bytes - card.used_bytes == free_bytes
        assert free_bytes == (
            total_bytes - cuda.outside_allocator_bytes - 30 * MiB - cuda.memory_reserved(0)
        )
        del held


def test_a_mig_slice_is_listed_under_its_card_with_its_own_memory() -> None:
    gpu = small_gpu()
    mig = MigSlice(profile="3g.40gb", memory_bytes=300 * MiB, sm_count=1)
    with SimulatedCuda(gpu, mig=mig) as cuda:
        props = cuda.properties(0)
        assert props.name == f"{gpu.nvidia_smi_name} MIG 3g.40gb"
        assert props.total_memory_bytes == 300 * MiB
        card, slice_device = read_gpus(cuda.nvml())
        assert not card.mig and card.uuid.startswith("GPU-")
        assert slice_device.mig and slice_device.uuid == f"MIG-{props.uuid}"
        assert slice_device.name == props.name
        assert slice_device.total_memory_bytes == 300 * MiB
        assert slice_device.total_memory_bytes - slice_device.used_bytes == cuda.free_bytes()
        # The slice's context backs the stacks of its own SMs only.
        assert cuda.bare_context_bytes < context_bytes(gpu) - STEP_KERNELS_BYTES


def test_nvml_errors_and_absence() -> None:
    with SimulatedCuda(small_gpu(), nvml="no_permission") as cuda:
        with pytest.raises(DeviceError, match="Insufficient Permissions"):
            read_gpus(cuda.nvml())
    with SimulatedCuda(small_gpu(), nvml="not_loaded") as cuda:
        assert read_gpus(cuda.nvml()) == []
    with SimulatedCuda(small_gpu(), nvml_installed=False) as cuda:
        assert cuda.nvml() is None
    # A card without MIG answers NOT_SUPPORTED to the MIG query, which means "no MIG".
    with SimulatedCuda(small_gpu("RTX 4090")) as cuda:
        (card,) = read_gpus(cuda.nvml())
        assert not card.mig


def test_one_device_only() -> None:
    with SimulatedCuda(small_gpu()) as cuda:
        assert cuda.device_count() == 1
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            cuda.memory_reserved(1)
    with pytest.raises(RuntimeError, match="enter the SimulatedCuda"):
        SimulatedCuda(small_gpu()).initialize(0)
