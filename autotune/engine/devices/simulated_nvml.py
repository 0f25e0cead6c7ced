"""NVML for the simulated GPU: the pynvml calls `autotune.engine.devices.nvml.read_gpus` makes,
answered from a simulated machine's memory (docs/design.md#the-simulated-cuda-backend).

Errors are pynvml's own `NVMLError`, with NVML's codes, so `read_gpus` handles them as it would
the real library's. Memory follows NVML's v1 memory info, which pynvml returns by default:
`used` includes the driver's reserve (the gap between NVML's total and CUDA's), so used + free =
total, and `free` is what `cudaMemGetInfo` reports free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import pynvml

NvmlState = Literal["available", "no_permission", "not_loaded"]
"""How NVML answers: normally; refusing device queries with NVML_ERROR_NO_PERMISSION (a container
on a cgroup-isolated node, a MIG slice without monitoring rights); or failing `nvmlInit` with
NVML_ERROR_DRIVER_NOT_LOADED."""

DRIVER_VERSION = "550.54.15"
CUDA_DRIVER_VERSION = 12040  # NVML's integer form of 12.4
# What NVML's nvmlDeviceGetMaxMigDeviceCount answers on an A100/H100 (7 GPU instances).
MAX_MIG_DEVICES = 7


@dataclass(frozen=True)
class NvmlMemory:
    """nvmlMemory_t: total, free and used bytes."""

    total: int
    free: int
    used: int


@dataclass(frozen=True)
class NvmlDevice:
    """One device NVML lists: a GPU, or a MIG device of one (`mig`). `free_bytes` is read when
    asked, as NVML reads it."""

    name: str
    uuid: str
    total_bytes: int
    free_bytes: Callable[[], int]
    mig: bool = False


class SimulatedNvml:
    """The NVML library of a machine with one GPU (`gpu`), in MIG mode when `mig_device` is
    given (its only MIG device), answering as `state` says. Implements
    `autotune.engine.devices.nvml.NvmlLibrary`."""

    NVMLError = pynvml.NVMLError

    def __init__(
        self,
        gpu: NvmlDevice,
        *,
        mig_device: NvmlDevice | None = None,
        mig_capable: bool = True,
        state: NvmlState = "available",
    ) -> None:
        self._gpu = gpu
        self._mig_device = mig_device
        self._mig_capable = mig_capable
        self._state = state
        self._initialized = 0

    def _error(self, code: int) -> Exception:
        error: Exception = pynvml.NVMLError(code)
        return error

    def _check(self) -> None:
        if self._initialized <= 0:
            raise self._error(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:
        if self._state == "not_loaded":
            raise self._error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self._initialized += 1

    def nvmlShutdown(self) -> None:
        self._check()
        self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return DRIVER_VERSION

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check()
        return CUDA_DRIVER_VERSION

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> NvmlDevice:
        self._check()
        if index != 0:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu

    def nvmlDeviceGetName(self, handle: NvmlDevice) -> str:
        self._check()
        return handle.name

    def nvmlDeviceGetUUID(self, handle: NvmlDevice) -> str:
        self._check()
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: NvmlDevice) -> NvmlMemory:
        self._check()
        if self._state == "no_permission":
            raise self._error(pynvml.NVML_ERROR_NO_PERMISSION)
        free_bytes = handle.free_bytes()
        return NvmlMemory(
            total=handle.total_bytes, free=free_bytes, used=handle.total_bytes - free_bytes
        )

    def nvmlDeviceGetMigMode(self, handle: NvmlDevice) -> list[int]:
        self._check()
        if not self._mig_capable or handle.mig:
            raise self._error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if self._mig_device is not None else 0
        return [mode, mode]  # current, pending

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: NvmlDevice) -> int:
        self._check()
        return MAX_MIG_DEVICES if self._mig_device is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: NvmlDevice, index: int) -> NvmlDevice:
        self._check()
        if index == 0 and self._mig_device is not None:
            return self._mig_device
        raise self._error(pynvml.NVML_ERROR_NOT_FOUND)
