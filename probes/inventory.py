"""The worker's inventory: the devices it offers when it claims runs, and how to open each.

* "cpu": one emulated GPU of `--memory` bytes, or the named `--gpu` (its capacity for one rank:
  each run's trials open it for the run's world size);
* "estimate": every GPU of the catalogue (`autotune.core.gpus.catalogue`), estimated on fake
  tensors (`autotune.engine.estimate`): no device is used, so one worker answers estimates for
  all;
* "cuda": every GPU torch sees; "cuda:N": that one. Each is read in a child process through
  `autotune.engine.devices.cuda_device.CudaDevice` (NVML: name, UUID, total memory, driver and CUDA
  versions; plus the torch version), so that no CUDA context lives on in the worker itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from autotune.core.bytesize import format_bytes
from autotune.core.errors import SpecError
from autotune.core.memory.allocator_config import AllocatorConfig, settings_text
from autotune.core.schemas import DeviceInfo, DeviceKind
from probes.isolation import read_devices

logger = logging.getLogger(__name__)

INVENTORY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class WorkerDevice:
    """A device this worker can run trials on: what it tells the server, and the arguments of
    `autotune.engine.devices.device.open_device` a trial's child process opens it with."""

    info: DeviceInfo
    device_name: str
    memory_bytes: int | None
    gpu: str | None = None


ESTIMATE_DEVICE = "estimate"


def estimate_inventory(allocator_config: AllocatorConfig) -> list[WorkerDevice]:
    """One estimate device per catalogue GPU, with this worker's allocator settings.

    One small estimate is traced here: the first estimate in a process pays about 2 s of
    one-time work (lazy imports, fake-tensor caches), which would otherwise delay the first
    answer, the one a user long-polls for right after the server started."""
    from autotune.core.gpus.catalogue import GPUS
    from autotune.core.schemas import ModelSpec, Spec
    from autotune.engine.estimate import EstimateRunner, estimate_device

    warm = EstimateRunner(Spec(model=ModelSpec(preset="mlp")), capacity_bytes=2**30)
    warm.warm_up(checkpointing=False)
    warm.trial(2, 2, checkpointing=False)
    return [
        WorkerDevice(
            estimate_device(gpu.name, allocator_config=allocator_config),
            ESTIMATE_DEVICE,
            None,
            gpu.name,
        )
        for gpu in GPUS
    ]


def default_device_name(gpu: str | None = None) -> str:
    """ "cpu" for a named GPU; else "cuda" when NVML lists a GPU, else "cpu" (without touching
    CUDA here)."""
    from autotune.engine.devices.nvml import read_gpus

    return "cpu" if gpu is not None or not read_gpus() else "cuda"


def read_inventory(
    device_name: str,
    memory_bytes: int | None,
    gpu: str | None = None,
    *,
    allocator_config: AllocatorConfig | None = None,
) -> list[WorkerDevice]:
    """The devices for a `--device` / `--memory` / `--gpu` choice, under the caching
    allocator's settings the worker started with (`allocator_config`, read by its entry point;
    None: torch's defaults), which its trial children's CUDA starts with too.

    Raises:
        SpecError: "cpu" without a memory size or a GPU, an unknown device or GPU name, or a
            GPU name with a CUDA device.
        DeviceError: CUDA was asked for and is unavailable.
    """
    allocator_config = allocator_config or AllocatorConfig()
    if device_name == ESTIMATE_DEVICE:
        if memory_bytes is not None or gpu is not None:
            raise SpecError("--device estimate: estimates every catalogue GPU; no --memory/--gpu")
        devices = estimate_inventory(allocator_config)
        logger.info("estimates for %d catalogue GPUs", len(devices))
        return devices
    if device_name == "cpu" or gpu is not None:
        from autotune.engine.devices.device import open_device  # refuses what cannot be opened

        info = open_device(
            device_name, memory_bytes, gpu=gpu, allocator_config=allocator_config
        ).info
        devices = [WorkerDevice(info, device_name, memory_bytes, gpu)]
    else:
        infos = read_devices(
            device_name,
            memory_bytes,
            timeout_s=INVENTORY_TIMEOUT_S,
            allocator_conf=settings_text(allocator_config),
        )
        devices = [
            WorkerDevice(info, f"cuda:{info.index}", memory_bytes)
            for info in infos
            if info.kind == DeviceKind.CUDA
        ]
    for device in devices:
        info = device.info
        logger.info(
            "device %s: %s, capacity %s (total %s)%s",
            device.device_name,
            info.name,
            format_bytes(info.capacity_bytes),
            format_bytes(info.total_memory_bytes),
            f", driver {info.driver_version}, CUDA {info.cuda_version}"
            if info.driver_version
            else "",
        )
    return devices
