"""What GPUs this machine has, read through NVML; torch-free, and pynvml is imported lazily.

NVML numbers GPUs in PCI-bus order and ignores CUDA_VISIBLE_DEVICES, so `GpuInfo.index` is the
NVML index: match a torch device to its GpuInfo by `uuid`, never by index.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from autotune.core.errors import DeviceError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it. `used_bytes` includes other processes and CUDA contexts."""

    index: int
    name: str
    uuid: str
    total_memory_bytes: int
    used_bytes: int
    driver_version: str
    cuda_version: str


def format_cuda_version(version: int) -> str:
    """NVML's integer CUDA driver version as "major.minor": 12040 -> "12.4" (nvml.h macros)."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str, but old pynvml releases returned bytes.
    return value.decode() if isinstance(value, bytes) else value


def read_gpus() -> list[GpuInfo]:
    """Every GPU NVML can see, or [] when NVML (the package or the driver library) is missing.

    Raises:
        DeviceError: NVML initialised but then failed to read a GPU.
    """
    try:
        import pynvml
    except ImportError:
        logger.info("no GPU inventory: the nvidia-ml-py package (module pynvml) is not installed")
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        logger.info("no GPU inventory: NVML is unavailable (%s)", error)
        return []
    try:
        driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda_version = format_cuda_version(int(pynvml.nvmlSystemGetCudaDriverVersion()))
        gpus = []
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GpuInfo(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    total_memory_bytes=int(memory.total),
                    used_bytes=int(memory.used),
                    driver_version=driver_version,
                    cuda_version=cuda_version,
                )
            )
        return gpus
    except pynvml.NVMLError as error:
        # NVML answered nvmlInit, so a failure now is a real problem (a lost GPU, a driver
        # mismatch), not a machine without GPUs.
        raise DeviceError(f"NVML failed while listing GPUs: {error}") from error
    finally:
        pynvml.nvmlShutdown()
