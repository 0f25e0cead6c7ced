"""The CUDA runtime `CudaDevice` talks to: torch.cuda's device and memory functions and NVML.

`CudaRuntime` is the seam. `TorchCudaRuntime` is the real one (torch.cuda and pynvml); the
simulated one (`autotune.engine.devices.simulated_cuda.SimulatedCuda`) drives the same calls from
the caching-allocator model on CPU tensors, so that `CudaDevice`'s own code runs in CI. The entry
point picks one (`autotune.engine.devices.device.open_device`: the real one unless told otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from autotune.engine.devices.nvml import NvmlLibrary, load_pynvml


@dataclass(frozen=True)
class CudaProperties:
    """`torch.cuda.get_device_properties(index)`: the name CUDA gives the device (a MIG device's
    ends with its profile, "... MIG 3g.40gb"), its UUID as torch prints it (bare, no "GPU-" or
    "MIG-"), and its total memory as CUDA reports it."""

    name: str
    uuid: str
    total_memory_bytes: int


class CudaRuntime(Protocol):
    """What `CudaDevice` asks of CUDA, named after the torch.cuda function each one is (`index`
    is the CUDA device index, as CUDA_VISIBLE_DEVICES numbers it)."""

    @property
    def cuda_version(self) -> str | None:
        """`torch.version.cuda`: the CUDA torch was built for."""
        ...

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...

    def torch_device(self, index: int) -> torch.device:
        """Where the step's tensors live."""
        ...

    def initialize(self, index: int) -> None:
        """Create the CUDA context on the device (torch does it at the first tensor)."""
        ...

    def properties(self, index: int) -> CudaProperties: ...

    def mem_get_info(self, index: int) -> tuple[int, int]:
        """(free, total) bytes, as `cudaMemGetInfo` reports them."""
        ...

    def memory_allocated(self, index: int) -> int: ...

    def memory_reserved(self, index: int) -> int: ...

    def max_memory_allocated(self, index: int) -> int: ...

    def max_memory_reserved(self, index: int) -> int: ...

    def num_alloc_retries(self, index: int) -> int:
        """`memory_stats()["num_alloc_retries"]`: mallocs that freed the cache and retried."""
        ...

    def reset_peak_memory_stats(self, index: int) -> None: ...

    def empty_cache(self) -> None: ...

    def synchronize(self, index: int) -> None: ...

    def set_per_process_memory_fraction(self, fraction: float, index: int) -> None: ...

    def nvml(self) -> NvmlLibrary | None:
        """The NVML library (pynvml), or None when it is not installed."""
        ...


class TorchCudaRuntime:
    """The real CUDA runtime: torch.cuda, and pynvml for NVML."""

    @property
    def cuda_version(self) -> str | None:
        return torch.version.cuda

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def torch_device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def initialize(self, index: int) -> None:
        torch.zeros(1, device=self.torch_device(index))

    def properties(self, index: int) -> CudaProperties:
        props = torch.cuda.get_device_properties(index)
        return CudaProperties(
            name=props.name, uuid=str(props.uuid), total_memory_bytes=props.total_memory
        )

    def mem_get_info(self, index: int) -> tuple[int, int]:
        free_bytes, total_bytes = torch.cuda.mem_get_info(index)
        return free_bytes, total_bytes

    def memory_allocated(self, index: int) -> int:
        return torch.cuda.memory_allocated(index)

    def memory_reserved(self, index: int) -> int:
        return torch.cuda.memory_reserved(index)

    def max_memory_allocated(self, index: int) -> int:
        return torch.cuda.max_memory_allocated(index)

    def max_memory_reserved(self, index: int) -> int:
        return torch.cuda.max_memory_reserved(index)

    def num_alloc_retries(self, index: int) -> int:
        return int(torch.cuda.memory_stats(index).get("num_alloc_retries", 0))

    def reset_peak_memory_stats(self, index: int) -> None:
        torch.cuda.reset_peak_memory_stats(index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self, index: int) -> None:
        torch.cuda.synchronize(index)

    def set_per_process_memory_fraction(self, fraction: float, index: int) -> None:
        torch.cuda.set_per_process_memory_fraction(fraction, index)

    def nvml(self) -> NvmlLibrary | None:
        return load_pynvml()
