"""CudaDevice on a GPU: identity matched through NVML, a trial that fits, one that runs out of
memory on purpose, and the memory it gives back. Every test runs on the simulated CUDA backend
and, where there is one, on a real GPU (marked `gpu`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from autotune.core.schemas import DeviceKind, Phase
from autotune.engine.devices.cuda_device import CudaDevice
from autotune.engine.devices.cuda_runtime import CudaRuntime, TorchCudaRuntime
from autotune.engine.devices.device import open_device
from autotune.engine.devices.nvml import read_gpus
from autotune.engine.devices.simulated_cuda import SimulatedCuda
from tests.autotune_tests.engine.simulated_gpus import small_gpu

MiB = 2**20
_REAL_GPU = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.fixture(params=["simulated", _REAL_GPU])
def cuda(request: pytest.FixtureRequest) -> Iterator[CudaRuntime]:
    if request.param == "cuda":
        yield TorchCudaRuntime()
        return
    with SimulatedCuda(small_gpu(total_mib=1024)) as simulated:
        yield simulated


@pytest.fixture
def device(cuda: CudaRuntime) -> CudaDevice:
    return CudaDevice(0, runtime=cuda)


def test_info_matches_nvml(cuda: CudaRuntime, device: CudaDevice) -> None:
    info = device.info
    assert info.kind is DeviceKind.CUDA
    assert info.index == 0
    assert info.name == cuda.properties(0).name
    assert info.uuid is not None and info.uuid.startswith(("GPU-", "MIG-"))
    assert 0 < info.capacity_bytes <= info.total_memory_bytes
    assert device.torch_device == cuda.torch_device(0)
    gpus = {gpu.uuid.lower(): gpu for gpu in read_gpus(cuda.nvml())}
    if gpus:  # NVML present: the UUID must be one it knows, whatever CUDA_VISIBLE_DEVICES says
        gpu = gpus[info.uuid.lower()]
        assert info.total_memory_bytes == gpu.total_memory_bytes
        assert info.driver_version == gpu.driver_version
        assert info.cuda_version == gpu.cuda_version
        # The capacity is what NVML reports free, give or take this process's caches.
        assert info.capacity_bytes >= gpu.total_memory_bytes - gpu.used_bytes - 64 * MiB


def _training_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int, on: torch.device
) -> None:
    x = torch.randn(batch, 256, device=on)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_trial_that_fits(device: CudaDevice) -> None:
    on = device.torch_device
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    )
    model.to(on)
    optimizer = torch.optim.AdamW(model.parameters())
    _training_step(model, optimizer, 8, on)
    resident = [*model.parameters(), *(t for s in optimizer.state.values() for t in s.values())]
    outcome = device.run_trial(
        lambda: _training_step(model, optimizer, 64, on),
        micro_batch=64,
        resident=resident,
        record_series=True,
    )
    assert outcome.fits
    assert outcome.oom_phase is None
    assert set(outcome.phase_peak_bytes) == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    # Reserved memory covers at least every byte the tracker saw allocated.
    assert outcome.peak_bytes >= max(outcome.phase_peak_bytes.values())
    assert outcome.series is not None and len(outcome.series) > 10


def _reserved_after_empty_cache(cuda: CudaRuntime) -> int:
    cuda.synchronize(0)
    cuda.empty_cache()
    return cuda.memory_reserved(0)


def test_trial_that_runs_out_of_memory_and_cleans_up(
    cuda: CudaRuntime, device: CudaDevice
) -> None:
    on = device.torch_device
    kept = torch.ones(1024, device=on)
    allocated_before = cuda.memory_allocated(0)
    reserved_before = _reserved_after_empty_cache(cuda)
    held: list[torch.Tensor] = []

    def step() -> None:
        held.append(torch.ones(16 * MiB, device=on))  # 64 MiB that the step keeps
        # More than the whole card: the caching allocator must refuse it.
        total_bytes = device.info.total_memory_bytes
        held.append(torch.empty(total_bytes * 2, dtype=torch.uint8, device=on))

    outcome = device.run_trial(step, micro_batch=1, resident=[kept])
    assert not outcome.fits
    assert outcome.oom_phase is Phase.FORWARD
    assert outcome.peak_bytes >= reserved_before + 64 * MiB
    held.clear()
    assert cuda.memory_allocated(0) == allocated_before
    # The next trial measures from a clean slate, not from the failed trial's cached blocks: a
    # 4 MiB tensor takes a 20 MiB segment (requests of 1-10 MiB do), its sum's scalar at most a
    # new 2 MiB one.
    small = device.run_trial(
        lambda: torch.ones(MiB, device=on).sum(), micro_batch=1, resident=[kept]
    )
    assert small.fits
    assert reserved_before + 20 * MiB <= small.peak_bytes <= reserved_before + 22 * MiB


def test_frames_of_a_failed_step_are_released(cuda: CudaRuntime, device: CudaDevice) -> None:
    on = device.torch_device
    allocated_before = cuda.memory_allocated(0)
    reserved_before = _reserved_after_empty_cache(cuda)

    def step() -> None:
        activation = torch.ones(16 * MiB, device=on)  # only the failing frame holds it
        torch.empty(device.info.total_memory_bytes * 2, dtype=torch.uint8, device=on)
        del activation

    assert not device.run_trial(step, micro_batch=1, resident=[]).fits
    # pytorch#18853: the traceback held `activation`; run_trial frees it and empties the cache.
    assert cuda.memory_allocated(0) == allocated_before
    assert cuda.memory_reserved(0) <= reserved_before


def test_memory_cap_below_the_card(cuda: CudaRuntime) -> None:
    cap_bytes = _reserved_after_empty_cache(cuda) + 256 * MiB
    capped = open_device("cuda:0", cap_bytes, cuda=cuda)
    on = capped.torch_device
    assert capped.info.capacity_bytes == cap_bytes
    fits = capped.run_trial(lambda: torch.ones(MiB, device=on).sum(), micro_batch=1, resident=[])
    assert fits.fits
    # 512 MiB is fine for the card but over the user's cap: the capped allocator refuses it.
    over = capped.run_trial(
        lambda: torch.ones(128 * MiB, device=on).sum(), micro_batch=1, resident=[]
    )
    assert not over.fits
    assert over.peak_bytes <= cap_bytes
    assert over.oom_phase is Phase.FORWARD
