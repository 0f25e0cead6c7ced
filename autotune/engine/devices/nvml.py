"""What GPUs this machine has, read through NVML; torch-free, and pynvml is imported lazily.

NVML numbers GPUs in PCI-bus order and ignores CUDA_VISIBLE_DEVICES, so `GpuInfo.index` is the
NVML index: match a torch device to its GpuInfo by `uuid`, never by index. A GPU in MIG mode is
listed with each of its MIG devices (UUID "MIG-...", its slice's memory), which is what CUDA
enumerates on it.

`read_gpus` takes the NVML library as an argument: pynvml (nvidia-ml-py) in production, the
simulated one of `autotune.engine.devices.simulated_nvml` in tests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from autotune.core.errors import DeviceError

logger = logging.getLogger(__name__)

# NVML's constants NVML_DEVICE_MIG_ENABLE, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION and
# NVML_ERROR_NOT_FOUND (pynvml's NVMLError carries the code as `value`).
MIG_ENABLED = 1
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6


class NvmlLibrary(Protocol):
    """The part of pynvml's interface that `read_gpus` calls (pynvml's names; its handles and
    memory structs are opaque here). `NVMLError` is pynvml's exception class, whose `value` is
    the NVML return code."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str | bytes: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]: ...
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int: ...
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any: ...


@dataclass(frozen=True)
class GpuInfo:
    """One GPU (or one MIG device of a GPU) as NVML reports it. `used_bytes` includes other
    processes and CUDA contexts, and the driver's reserve (NVML's v1 memory info: used + free =
    total). `index` is the NVML index of the GPU (of the parent GPU, for a MIG device)."""

    index: int
    name: str
    uuid: str
    total_memory_bytes: int
    used_bytes: int
    driver_version: str
    cuda_version: str
    mig: bool = False


def format_cuda_version(version: int) -> str:
    """NVML's integer CUDA driver version as "major.minor": 12040 -> "12.4"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str, but old pynvml releases returned bytes.
    return value.decode() if isinstance(value, bytes) else value


def load_pynvml() -> NvmlLibrary | None:
    """pynvml (nvidia-ml-py), or None when it is not installed."""
    try:
        import pynvml
    except ImportError:
        logger.info("no GPU inventory: the nvidia-ml-py package (module pynvml) is not installed")
        return None
    library: NvmlLibrary = pynvml
    return library


def read_gpus(library: NvmlLibrary | None = None) -> list[GpuInfo]:
    """Every GPU NVML can see (and every MIG device of a GPU in MIG mode), or [] when NVML (the
    package or the driver library) is missing. `library`: pynvml when None.

    Raises:
        DeviceError: NVML initialised but then failed to read a GPU (no permission in a
            container, a lost GPU, a driver mismatch).
    """
    nvml = library if library is not None else load_pynvml()
    if nvml is None:
        return []
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        logger.info("no GPU inventory: NVML is unavailable (%s)", error)
        return []
    try:
        driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        cuda_version = format_cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion()))
        gpus = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            handles = [(handle, False)] + [(h, True) for h in _mig_handles(nvml, handle)]
            for device, mig in handles:
                memory = nvml.nvmlDeviceGetMemoryInfo(device)
                gpus.append(
                    GpuInfo(
                        index=index,
                        name=_text(nvml.nvmlDeviceGetName(device)),
                        uuid=_text(nvml.nvmlDeviceGetUUID(device)),
                        total_memory_bytes=int(memory.total),
                        used_bytes=int(memory.used),
                        driver_version=driver_version,
                        cuda_version=cuda_version,
                        mig=mig,
                    )
                )
        return gpus
    except nvml.NVMLError as error:
        # NVML answered nvmlInit, so a failure now is a real problem (no permission, a lost
        # GPU, a driver mismatch), not a machine without GPUs.
        raise DeviceError(f"NVML failed while listing GPUs: {error}") from error
    finally:
        nvml.nvmlShutdown()


def _mig_handles(nvml: NvmlLibrary, handle: Any) -> list[Any]:
    """The MIG devices of a GPU in MIG mode; [] for a GPU that has no MIG mode or has it off."""
    try:
        current_mode = nvml.nvmlDeviceGetMigMode(handle)[0]
    except nvml.NVMLError as error:
        if getattr(error, "value", None) == ERROR_NOT_SUPPORTED:  # a GPU without MIG
            return []
        raise
    if current_mode != MIG_ENABLED:
        return []
    handles = []
    for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            handles.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
        except nvml.NVMLError as error:
            if getattr(error, "value", None) != ERROR_NOT_FOUND:  # an empty slot
                raise
    return handles
