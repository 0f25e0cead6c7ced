"""The real GPU: `CudaDevice` runs a trial on a CUDA device and measures it with the caching
allocator's statistics; its capacity is read through NVML (`autotune.engine.devices.nvml`).
Out-of-memory is caught by `autotune.engine.devices.out_of_memory`, as for the emulated device.

It talks to CUDA only through a `CudaRuntime` (`autotune.engine.devices.cuda_runtime`): torch.cuda
and pynvml in production, the simulated backend (`autotune.engine.devices.simulated_cuda`) in
tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from autotune.core.errors import DeviceError
from autotune.core.memory.allocator_config import AllocatorConfig, canonical_conf
from autotune.core.memory.resident_placement import ResidentPlacement, TrialStart
from autotune.core.schemas import DeviceInfo, DeviceKind, Phase, SpeedSource, StepOutcome
from autotune.engine.devices.cuda_runtime import CudaRuntime, TorchCudaRuntime
from autotune.engine.devices.nvml import GpuInfo, read_gpus
from autotune.engine.devices.out_of_memory import peak_phase, run_tracked
from autotune.engine.emulation.tracker import LiveBytesTracker, MemoryHolders

logger = logging.getLogger(__name__)


def _bare_uuid(uuid: str) -> str:
    # torch prints a CUDA UUID bare ("5f9e...-..."), NVML prefixes it ("GPU-5f9e...-...", or
    # "MIG-..." for a MIG device).
    uuid = uuid.strip().lower()
    return uuid.removeprefix("gpu-").removeprefix("mig-")


class CudaDevice:
    """A real CUDA GPU, or a MIG device of one. Its capacity is what is free once the CUDA
    context exists (NVML total minus NVML used, plus what this process's caching allocator
    already holds; when NVML cannot answer, cudaMemGetInfo's free plus the same), optionally
    capped at `memory_cap_bytes`: the cap limits the caching allocator itself
    (`set_per_process_memory_fraction`), so that a step runs as on a card of that size.
    The capacity is read again after the first step that completes (the runner's warm-up):
    CUDA loads kernels and creates library handles on first use, hundreds of MB on a large
    card. Headroom is not subtracted here: the probe applies it."""

    def __init__(
        self,
        index: int = 0,
        *,
        memory_cap_bytes: int | None = None,
        runtime: CudaRuntime | None = None,
        allocator_config: AllocatorConfig | None = None,
    ) -> None:
        cuda = runtime if runtime is not None else TorchCudaRuntime()
        if not cuda.is_available():
            raise DeviceError(
                f"CUDA is not available (torch {torch.__version__}, "
                f"built for CUDA {cuda.cuda_version or 'none'}); "
                "use --device cpu --memory SIZE to emulate a GPU"
            )
        count = cuda.device_count()
        if not 0 <= index < count:
            raise DeviceError(f"no CUDA device {index}: torch sees {count} (cuda:0..{count - 1})")
        self._cuda = cuda
        self._index = index
        # What torch read from this process's environment, as the entry point parsed it.
        self.allocator_config = allocator_config
        self._device = cuda.torch_device(index)
        # Create the context first, so NVML's "used" includes it: a step can never use it.
        cuda.initialize(index)
        cuda.synchronize(index)
        cuda.empty_cache()
        props = cuda.properties(index)
        self._limit_bytes: int | None = None
        if memory_cap_bytes is not None and memory_cap_bytes < props.total_memory_bytes:
            # Cap the allocator itself, as a card of that size would be: it frees its cache and
            # retries before running out. torch's limit is int(fraction x total).
            fraction = memory_cap_bytes / props.total_memory_bytes
            cuda.set_per_process_memory_fraction(fraction, index)
            self._limit_bytes = int(fraction * props.total_memory_bytes)
        # CUDA names a MIG device "<card> MIG <profile>"; NVML lists it as "MIG-<uuid>".
        prefix = "MIG-" if " MIG " in props.name else "GPU-"
        self._uuid = prefix + _bare_uuid(props.uuid)
        self._name = props.name
        # Provisional until a step has run: CUDA loads kernels, and cuBLAS/cuDNN create their
        # handles, at their first use, outside the allocator
        # (docs/design.md#named-gpus-and-what-cuda-takes).
        self._info = self._read_info()
        self._step_loaded = False
        # The warm-up's trace as the tracker saw it: where the card left the residents, which
        # the replays that predict its trials start from (the card needs no help).
        self.placement: ResidentPlacement | None = None
        self._last_outcome: StepOutcome | None = None

    def _nvml_gpu(self) -> GpuInfo | None:
        """This device as NVML lists it (matched by UUID), or None when NVML cannot say."""
        try:
            gpus = read_gpus(self._cuda.nvml())
        except DeviceError as error:
            # No permission on a cgroup-isolated node or in a MIG slice, a driver mismatch: the
            # memory CUDA reports is as good for the capacity.
            logger.warning("%s; reading free memory from CUDA", error)
            return None
        gpu = next((g for g in gpus if _bare_uuid(g.uuid) == _bare_uuid(self._uuid)), None)
        if gpu is None and gpus:
            logger.warning("NVML has no device with UUID %s; reading memory from CUDA", self._uuid)
        return gpu

    def _read_info(self) -> DeviceInfo:
        cuda, index = self._cuda, self._index
        # NVML counts this process's cached blocks as used, but a trial's max_memory_reserved
        # counts them too; add them back so they are not subtracted twice.
        reserved_bytes = cuda.memory_reserved(index)
        gpu = self._nvml_gpu()
        if gpu is not None:
            total_bytes = gpu.total_memory_bytes
            capacity_bytes = gpu.total_memory_bytes - gpu.used_bytes + reserved_bytes
        else:
            free_bytes, total_bytes = cuda.mem_get_info(index)
            capacity_bytes = free_bytes + reserved_bytes
        if self._limit_bytes is not None:
            capacity_bytes = min(capacity_bytes, self._limit_bytes)
        self.capacity_bytes = max(capacity_bytes, 0)
        return DeviceInfo(
            kind=DeviceKind.CUDA,
            speed=SpeedSource.MEASURED,
            name=self._name,
            index=index,
            uuid=self._uuid,
            total_memory_bytes=total_bytes,
            capacity_bytes=self.capacity_bytes,
            driver_version=gpu.driver_version if gpu else None,
            cuda_version=gpu.cuda_version if gpu else cuda.cuda_version,
            torch_version=torch.__version__,
            allocator_conf=canonical_conf(self.allocator_config)
            if self.allocator_config
            else None,
        )

    @property
    def info(self) -> DeviceInfo:
        return self._info

    @property
    def torch_device(self) -> torch.device:
        return self._device

    def run_trial(
        self,
        step: Callable[[], object],
        *,
        micro_batch: int,
        resident: Iterable[torch.Tensor],
        record_series: bool = False,
        track: bool = True,
        holders: Callable[[], MemoryHolders] | None = None,
    ) -> StepOutcome:
        self.synchronize()
        if track:
            # Blocks cached by an earlier, larger trial would count in this trial's reserved
            # peak. An untracked run times steps right after the tracked check of the same
            # configuration (`InProcessRunner.measure`): that check is their warm-up, and its
            # segments must stay cached, or the first timed step would wait on cudaMalloc.
            self._cuda.empty_cache()
        self._cuda.reset_peak_memory_stats(self._index)
        # Cumulative in torch (reset only with the accumulated statistics): this trial's count
        # is the difference.
        retries_before = self._cuda.num_alloc_retries(self._index)
        # No capacity: the card enforces its own. The tracker only labels phases and series.
        tracker = LiveBytesTracker(None, record_series=record_series) if track else None
        if tracker is not None:
            tracker.add_resident(resident)
        oom_phase = run_tracked(step, tracker, micro_batch=micro_batch)
        if oom_phase is None:
            self.synchronize()  # kernels may still be running; the peak is final only after
            if not self._step_loaded:
                # The first complete step loaded its kernels and handles: read the capacity
                # again, now that what CUDA takes outside the allocator is in NVML's "used".
                self._step_loaded = True
                self._info = self._read_info()
        else:
            self._cuda.empty_cache()
        peak_bytes = self._cuda.max_memory_reserved(self._index)
        peak_allocated_bytes = self._cuda.max_memory_allocated(self._index)
        num_alloc_retries = self._cuda.num_alloc_retries(self._index) - retries_before
        # Completing is not enough: the capacity, not the card, is what the probe plans with.
        fits = oom_phase is None and peak_bytes <= self.capacity_bytes
        phase_peak_bytes = dict(tracker.phase_peak_bytes) if tracker is not None else {}
        if oom_phase is None and not fits:
            oom_phase = peak_phase(phase_peak_bytes) or Phase.FORWARD
        recorded = tracker is not None and record_series and fits
        placement = self.placement
        outcome = StepOutcome(
            micro_batch=micro_batch,
            fits=fits,
            peak_bytes=peak_bytes,
            peak_allocated_bytes=peak_allocated_bytes,
            num_alloc_retries=num_alloc_retries,
            phase_peak_bytes=phase_peak_bytes,
            oom_phase=oom_phase,
            series=tuple(tracker.series) if tracker is not None and recorded else None,
            allocations=tuple(tracker.allocations) if tracker is not None and recorded else None,
            start=TrialStart(placement, tracker.resident_events)
            if tracker is not None and recorded and placement is not None
            else None,
        )
        if track:
            self._last_outcome = outcome
        return outcome

    def synchronize(self) -> None:
        self._cuda.synchronize(self._index)

    def after_warm_up(self) -> None:
        """The card keeps its residents where the warm-up put them; the trials' traces say so
        from now on (`EmulatedDevice.keep_placement`'s rule)."""
        warm_up = self._last_outcome
        if (
            self.placement is None
            and warm_up is not None
            and warm_up.fits
            and warm_up.allocations is not None
        ):
            self.placement = ResidentPlacement(warm_up.allocations)
