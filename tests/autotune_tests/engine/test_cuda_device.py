"""CudaDevice's own code path on the simulated CUDA backend: identity and capacity read through
NVML, trials measured with the caching allocator's statistics, out-of-memory as a value."""

from __future__ import annotations

import torch

from autotune.core.schemas import DeviceKind, Phase
from autotune.engine.cuda_device import CudaDevice
from autotune.engine.nvml import read_gpus
from autotune.engine.simulated_cuda import SimulatedCuda
from tests.autotune_tests.engine.simulated_gpus import MiB, small_gpu


def test_info_is_the_card_as_nvml_reports_it() -> None:
    gpu = small_gpu()
    with SimulatedCuda(gpu) as cuda:
        device = CudaDevice(0, runtime=cuda)
        info = device.info
        (card,) = read_gpus(cuda.nvml())
        assert info.kind is DeviceKind.CUDA
        assert (info.name, info.uuid) == (card.name, card.uuid)
        assert info.total_memory_bytes == card.total_memory_bytes == gpu.nvidia_smi_total_bytes
        assert (info.driver_version, info.cuda_version) == (card.driver_version, "12.4")
        assert info.capacity_bytes == card.total_memory_bytes - card.used_bytes
        assert device.torch_device == torch.device("cpu")


def test_a_trial_that_fits_is_measured_by_the_allocator_s_reserved_peak() -> None:
    with SimulatedCuda(small_gpu()) as cuda:
        device = CudaDevice(0, runtime=cuda)
        kept = torch.ones(1024)

        def step() -> None:
            torch.ones(3 * MiB, dtype=torch.uint8).sum()

        outcome = device.run_trial(step, micro_batch=1, resident=[kept])
        assert outcome.fits and outcome.oom_phase is None
        assert outcome.peak_bytes == cuda.max_memory_reserved(0)
        # 3 MiB in a 20 MiB segment, the scalar sum and `kept` in a 2 MiB one.
        assert outcome.peak_bytes == 22 * MiB


def test_a_trial_that_runs_out_is_a_value_and_leaves_the_device_clean() -> None:
    with SimulatedCuda(small_gpu()) as cuda:
        device = CudaDevice(0, runtime=cuda)
        allocated_bytes = cuda.memory_allocated(0)

        def step() -> None:
            held = torch.ones(16 * MiB, dtype=torch.uint8)
            torch.empty(device.info.total_memory_bytes, dtype=torch.uint8)
            del held

        outcome = device.run_trial(step, micro_batch=1, resident=[])
        assert not outcome.fits and outcome.oom_phase is Phase.FORWARD
        assert outcome.peak_bytes >= 16 * MiB
        assert cuda.memory_allocated(0) == allocated_bytes
        assert cuda.memory_reserved(0) == 0
