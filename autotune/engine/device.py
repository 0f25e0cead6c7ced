"""The device layer: run one training step as a trial and report whether it fit and its peak.

Two devices: `EmulatedDevice` (a CPU step under a `LiveBytesTracker` that raises out-of-memory
at a capacity) and `CudaDevice` (a real GPU, measured with the caching allocator's statistics).
This is the ONLY module in the project that catches out-of-memory: it turns it into
`StepOutcome(fits=False)`, and lets every other exception through unchanged.
"""

from __future__ import annotations

import gc
import itertools
import logging
import re
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from autotune.core.bytesize import format_bytes
from autotune.core.cuda_reserve import GpuBudget, budget_for
from autotune.core.errors import DeviceError, SpecError
from autotune.core.gpus import UnknownGpu, find_gpu
from autotune.core.schemas import DeviceInfo, DeviceKind, Phase, StepOutcome
from autotune.engine.attention import gpu_attention
from autotune.engine.nvml import read_gpus
from autotune.engine.tracker import CUDA_BLOCK_BYTES, LiveBytesTracker

logger = logging.getLogger(__name__)

# Out-of-memory failures that arrive as a plain RuntimeError: the CPU allocator's (e.g. under
# RLIMIT_AS, see docs/design.md#a-real-cpu-out-of-memory-is-a-signal-not-a-budget) and a
# failed raw cudaMalloc outside the caching allocator.
_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "CUDA error: out of memory")
_CUDA_NAME = re.compile(r"^cuda(?::(\d+))?$")


class Device(Protocol):
    """Where trials run. `run_trial` runs `step()` once, counting `resident` tensors (parameters,
    gradients, optimizer state, inputs that exist before the step) as already allocated. It
    returns `fits=False` on out-of-memory, raises anything else unchanged, and leaves the
    device clean for the next trial either way. Probe on a throwaway model and optimizer: an
    out-of-memory inside `optimizer.step()` leaves parameters half updated.

    `track=False` runs without the dispatch-mode tracker, for timing: the tracker costs about
    10-30 us per op. The emulated device then cannot enforce its capacity (peak_bytes is 0),
    so untracked trials are only for steps already shown to fit under tracking."""

    @property
    def info(self) -> DeviceInfo: ...

    @property
    def torch_device(self) -> torch.device: ...

    def run_trial(
        self,
        step: Callable[[], object],
        *,
        micro_batch: int,
        resident: Iterable[torch.Tensor],
        record_series: bool = False,
        track: bool = True,
    ) -> StepOutcome: ...

    def synchronize(self) -> None: ...


def is_out_of_memory(error: BaseException) -> bool:
    """True for `torch.OutOfMemoryError` (real CUDA or emulated) and for the RuntimeErrors that a
    failed CPU allocation or raw cudaMalloc raise."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MESSAGES)


def _run_tracked(step: Callable[[], object], tracker: LiveBytesTracker | None) -> Phase | None:
    """Run `step()` under `tracker` (or bare); return None if it completed, else the phase that
    ran out (FORWARD when untracked: nothing labels phases then)."""
    oom_phase: Phase | None = None
    try:
        if tracker is None:
            step()
        else:
            with tracker:
                step()
    except RuntimeError as error:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(error):
            raise
        # Only record here. pytorch#18853: the exception's traceback keeps the step's frames,
        # and with them its tensors, alive; memory is freed only once we have left `except`.
        oom_phase = tracker.phase if tracker is not None else Phase.FORWARD
        logger.debug("trial ran out of memory in %s: %s", oom_phase.value, error)
    if oom_phase is not None:
        gc.collect()
    return oom_phase


def _with_gpu_attention(step: Callable[[], object]) -> Callable[[], object]:
    def attended() -> object:
        with gpu_attention():
            return step()

    return attended


def _peak_phase(phase_peak_bytes: dict[Phase, int]) -> Phase | None:
    return max(phase_peak_bytes, key=phase_peak_bytes.__getitem__, default=None)


class EmulatedDevice:
    """A GPU emulated on the CPU: real CPU steps, GPU-like accounting. Either `capacity_bytes`
    (`--memory`: what the step's tensors may use, nothing taken off) or `gpu`, a named GPU as one
    rank sees it (`autotune.core.cuda_reserve`): its capacity is the card's total less what CUDA
    takes outside the allocator, and the BLAS workspaces torch keeps inside the allocator are
    resident in every step, as on the card (docs/design.md#named-gpus-and-what-cuda-takes)."""

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        gpu: GpuBudget | None = None,
        block_bytes: int = CUDA_BLOCK_BYTES,
    ) -> None:
        if (capacity_bytes is None) == (gpu is None):
            raise ValueError("the emulated device takes exactly one of capacity_bytes and gpu")
        self.block_bytes = block_bytes
        # Untouched CPU buffers standing for the workspaces: counted, never written, so they
        # cost address space only.
        self._workspaces: tuple[torch.Tensor, ...] = ()
        self._kept_free_bytes = 0
        if gpu is not None:
            self.capacity_bytes = gpu.capacity_bytes
            self._workspaces = tuple(
                torch.empty(size, dtype=torch.uint8) for size in gpu.blas_workspace_sizes
            )
            self._kept_free_bytes = gpu.reserve.kernel_workspace_bytes
            self._info = DeviceInfo(
                kind=DeviceKind.EMULATED,
                name=f"emulated {gpu.gpu.name} on cpu",
                total_memory_bytes=gpu.gpu.total_memory_bytes,
                capacity_bytes=gpu.capacity_bytes,
                torch_version=torch.__version__,
                gpu=gpu.gpu.name,
                reserve=gpu.reserve,
                assumptions=list(gpu.assumptions),
            )
            return
        assert capacity_bytes is not None
        if capacity_bytes <= 0:
            raise SpecError(
                f"memory: the emulated device needs a positive size, got {capacity_bytes}"
            )
        self.capacity_bytes = capacity_bytes
        self._info = DeviceInfo(
            kind=DeviceKind.EMULATED,
            name=f"emulated GPU ({format_bytes(capacity_bytes)}) on cpu",
            total_memory_bytes=capacity_bytes,
            capacity_bytes=capacity_bytes,
            torch_version=torch.__version__,
        )

    @property
    def info(self) -> DeviceInfo:
        return self._info

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def run_trial(
        self,
        step: Callable[[], object],
        *,
        micro_batch: int,
        resident: Iterable[torch.Tensor],
        record_series: bool = False,
        track: bool = True,
    ) -> StepOutcome:
        # Attention keeps for backward what a GPU's fused kernel keeps, tracked or timed.
        step = _with_gpu_attention(step)
        if not track:
            oom_phase = _run_tracked(step, None)
            return StepOutcome(
                micro_batch=micro_batch,
                fits=oom_phase is None,
                peak_bytes=0,
                phase_peak_bytes={},
                oom_phase=oom_phase,
                series=None,
            )
        limit_bytes = self.capacity_bytes - self._kept_free_bytes
        tracker = LiveBytesTracker(
            limit_bytes, block_bytes=self.block_bytes, record_series=record_series
        )
        tracker.add_resident(itertools.chain(resident, self._workspaces))
        oom_phase = _run_tracked(step, tracker)
        # The tracker raises before any op takes live bytes past capacity; only a resident
        # set that is already too big can leave a completed step over it.
        fits = oom_phase is None and tracker.peak_bytes <= limit_bytes
        if oom_phase is None and not fits:
            oom_phase = _peak_phase(tracker.phase_peak_bytes) or Phase.FORWARD
        return StepOutcome(
            micro_batch=micro_batch,
            fits=fits,
            peak_bytes=tracker.peak_bytes,
            phase_peak_bytes=dict(tracker.phase_peak_bytes),
            oom_phase=oom_phase,
            series=tuple(tracker.series) if record_series and fits else None,
        )

    def synchronize(self) -> None:
        """Nothing to wait for: CPU ops are synchronous."""


def _bare_uuid(uuid: str) -> str:
    # torch prints a CUDA UUID bare ("5f9e...-..."), NVML prefixes it ("GPU-5f9e...-...").
    uuid = uuid.strip().lower()
    return uuid.removeprefix("gpu-")


class CudaDevice:
    """A real CUDA GPU. Its capacity is what is free once the CUDA context exists (NVML total
    minus NVML used, plus what this process's caching allocator already holds), optionally
    capped at `memory_cap_bytes`. Headroom is not subtracted here: the probe applies it."""

    def __init__(self, index: int = 0, *, memory_cap_bytes: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise DeviceError(
                f"CUDA is not available (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'}); "
                "use --device cpu --memory SIZE to emulate a GPU"
            )
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise DeviceError(f"no CUDA device {index}: torch sees {count} (cuda:0..{count - 1})")
        self._index = index
        self._device = torch.device("cuda", index)
        # Create the context first, so NVML's "used" includes it: a step can never use it.
        torch.zeros(1, device=self._device)
        torch.cuda.synchronize(index)
        torch.cuda.empty_cache()
        props = torch.cuda.get_device_properties(index)
        uuid = "GPU-" + _bare_uuid(str(props.uuid))
        # NVML counts this process's cached blocks as used, but a trial's max_memory_reserved
        # counts them too; add them back so they are not subtracted twice.
        reserved_bytes = torch.cuda.memory_reserved(index)
        gpu = next((g for g in read_gpus() if _bare_uuid(g.uuid) == _bare_uuid(uuid)), None)
        if gpu is not None:
            total_bytes = gpu.total_memory_bytes
            capacity_bytes = gpu.total_memory_bytes - gpu.used_bytes + reserved_bytes
        else:
            logger.warning("NVML has no GPU with UUID %s; reading free memory from CUDA", uuid)
            free_bytes, total_bytes = torch.cuda.mem_get_info(index)
            capacity_bytes = free_bytes + reserved_bytes
        if memory_cap_bytes is not None:
            capacity_bytes = min(capacity_bytes, memory_cap_bytes)
        self.capacity_bytes = max(capacity_bytes, 0)
        self._info = DeviceInfo(
            kind=DeviceKind.CUDA,
            name=props.name,
            index=index,
            uuid=uuid,
            total_memory_bytes=total_bytes,
            capacity_bytes=self.capacity_bytes,
            driver_version=gpu.driver_version if gpu else None,
            cuda_version=gpu.cuda_version if gpu else torch.version.cuda,
            torch_version=torch.__version__,
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
    ) -> StepOutcome:
        # Blocks cached by an earlier, larger trial would count in this trial's reserved peak.
        self.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self._index)
        # No capacity: the card enforces its own. The tracker only labels phases and series.
        tracker = LiveBytesTracker(None, record_series=record_series) if track else None
        if tracker is not None:
            tracker.add_resident(resident)
        oom_phase = _run_tracked(step, tracker)
        if oom_phase is None:
            self.synchronize()  # kernels may still be running; the peak is final only after
        else:
            torch.cuda.empty_cache()
        peak_bytes = torch.cuda.max_memory_reserved(self._index)
        # The user's --memory cap can be below the card, so completing is not enough.
        fits = oom_phase is None and peak_bytes <= self.capacity_bytes
        phase_peak_bytes = dict(tracker.phase_peak_bytes) if tracker is not None else {}
        if oom_phase is None and not fits:
            oom_phase = _peak_phase(phase_peak_bytes) or Phase.FORWARD
        return StepOutcome(
            micro_batch=micro_batch,
            fits=fits,
            peak_bytes=peak_bytes,
            phase_peak_bytes=phase_peak_bytes,
            oom_phase=oom_phase,
            series=tuple(tracker.series)
            if tracker is not None and record_series and fits
            else None,
        )

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._index)


def open_device(
    name: str, memory_bytes: int | None = None, *, gpu: str | None = None, world_size: int = 1
) -> Device:
    """The device for a `--device` argument: "cpu" (emulated: `memory_bytes`, or the named `gpu`
    as one of `world_size` ranks sees it), "cuda" or "cuda:N" (where `memory_bytes`, if given,
    caps the capacity).

    Raises:
        SpecError: unknown device or GPU name; "cpu" without a memory size or a GPU, or with
            both; a GPU name with a real CUDA device.
        DeviceError: CUDA was asked for and is unavailable.
    """
    if memory_bytes is not None and memory_bytes <= 0:
        raise SpecError(f"memory: must be a positive size, got {memory_bytes}")
    if gpu is not None:
        # The one place these rules live: every command's --device/--memory/--gpu ends up here.
        if name != "cpu":
            raise SpecError(
                f"--gpu: names a GPU to emulate on the cpu device; {name!r} is measured as it is"
            )
        if memory_bytes is not None:
            raise SpecError("--gpu: the named GPU sets the capacity; give --gpu or --memory")
        try:
            named = find_gpu(gpu)
        except UnknownGpu as error:
            raise SpecError(f"--gpu: {error}") from None
        return EmulatedDevice(gpu=budget_for(named, world_size))
    if name == "cpu":
        if memory_bytes is None:
            raise SpecError(
                "--memory: required with the emulated cpu device (the GPU size to emulate, "
                'e.g. --memory 2GiB, or a named GPU: --gpu "H100 80GB")'
            )
        return EmulatedDevice(memory_bytes)
    match = _CUDA_NAME.match(name)
    if match is None:
        raise SpecError(f'device: unknown device {name!r}; use "cpu", "cuda" or "cuda:N"')
    return CudaDevice(int(match.group(1) or 0), memory_cap_bytes=memory_bytes)
