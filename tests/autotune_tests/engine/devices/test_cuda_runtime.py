"""The real CUDA runtime on a machine without a GPU: it says so, and its NVML is pynvml."""

from __future__ import annotations

import pytest
import torch

from autotune.engine.devices.cuda_runtime import TorchCudaRuntime
from autotune.engine.devices.nvml import read_gpus


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_without_cuda() -> None:
    import pynvml

    runtime = TorchCudaRuntime()
    assert not runtime.is_available()
    assert runtime.device_count() == 0
    assert runtime.cuda_version == torch.version.cuda
    assert runtime.nvml() is pynvml
    assert read_gpus(runtime.nvml()) == []  # NVML's library is not installed here
