"""The device layer: run one training step as a trial and report whether it fit and its peak.

`Device` is the contract, `EmulatedDevice` a CPU step under a `LiveBytesTracker` whose storages
live in a model of the CUDA caching allocator that runs out at a capacity, and `open_device`
picks a device for a `--device` argument (a real GPU is
`autotune.engine.devices.cuda_device.CudaDevice`). Out-of-memory is caught in one module only,
`autotune.engine.devices.out_of_memory`: it becomes `StepOutcome(fits=False)`, and every other
exception goes through unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from autotune.core.bytesize import format_bytes
from autotune.core.errors import SpecError
from autotune.core.gpus.catalogue import UnknownGpu, find_gpu
from autotune.core.gpus.cuda_reserve import BLAS_HANDLE_OPS, BLAS_THREADS, GpuBudget, budget_for
from autotune.core.memory.allocator import CachingAllocator
from autotune.core.memory.allocator_config import AllocatorConfig, canonical_conf
from autotune.core.memory.resident_placement import ResidentPlacement, TrialStart
from autotune.core.schemas import DeviceInfo, DeviceKind, Phase, SpeedSource, StepOutcome
from autotune.engine.devices.cuda_device import CudaDevice
from autotune.engine.devices.cuda_runtime import CudaRuntime
from autotune.engine.devices.out_of_memory import peak_phase, run_tracked
from autotune.engine.emulation.attention import gpu_attention
from autotune.engine.emulation.tracker import CUDA_BLOCK_BYTES, LiveBytesTracker, MemoryHolders

_CUDA_NAME = re.compile(r"^cuda(?::(\d+))?$")


class Device(Protocol):
    """Where trials run. `run_trial` runs `step()` once, counting `resident` tensors (parameters,
    gradients, optimizer state, inputs that exist before the step) as already allocated. It
    returns `fits=False` on out-of-memory, raises anything else unchanged, and leaves the
    device clean for the next trial either way. Probe on a throwaway model and optimizer: an
    out-of-memory inside `optimizer.step()` leaves parameters half updated.

    `track=False` runs without the dispatch-mode tracker, for timing: the tracker costs about
    10-30 us per op. The emulated device then cannot enforce its capacity (peak_bytes is 0),
    so untracked trials are only for steps already shown to fit under tracking, right after
    that tracked check: a CUDA device keeps the check's cached segments for them (its warm-up)."""

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
        holders: Callable[[], MemoryHolders] | None = None,
    ) -> StepOutcome: ...

    def synchronize(self) -> None: ...

    def after_warm_up(self) -> None:
        """The last tracked trial was the session's warm-up, and it fitted: the residents are
        where it left them for every later trial."""
        ...


def _with_gpu_attention(step: Callable[[], object]) -> Callable[[], object]:
    def attended() -> object:
        with gpu_attention():
            return step()

    return attended


def _is_catalogue_budget(budget: GpuBudget) -> bool:
    """Whether `budget` is its catalogue GPU's as one of its ranks sees it."""
    try:
        return budget == budget_for(find_gpu(budget.gpu.name), budget.world_size)
    except UnknownGpu:
        return False


class EmulatedDevice:
    """A GPU emulated on the CPU: real CPU steps, GPU-like accounting. Either `capacity_bytes`
    (`--memory`: what the caching allocator may reserve, nothing taken off) or `gpu`, a named GPU
    as one rank sees it (`autotune.core.gpus.cuda_reserve`): its capacity is the card's total less
    what CUDA takes outside the allocator, and the BLAS workspaces torch keeps inside the allocator
    are resident in every step, as on the card (docs/design.md#named-gpus-and-what-cuda-takes).

    Every trial's storages are malloc'd from a fresh model of the caching allocator
    (`allocator_config`: torch's defaults when None), so a step runs out where its *reserved*
    memory would pass the capacity after the allocator freed its cache and retried
    (docs/design.md#the-caching-allocator-on-the-emulated-gpu). Until the warm-up the residents
    are malloc'd first; after it (`after_warm_up`) every trial starts from the state the
    warm-up left, the residents where it put them (`placement`). `model_allocator=False` counts
    live tensor bytes against the capacity instead, as the emulated GPU did before: for
    comparisons only."""

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        gpu: GpuBudget | None = None,
        block_bytes: int = CUDA_BLOCK_BYTES,
        allocator_config: AllocatorConfig | None = None,
        model_allocator: bool = True,
    ) -> None:
        if (capacity_bytes is None) == (gpu is None):
            raise ValueError("the emulated device takes exactly one of capacity_bytes and gpu")
        self.block_bytes = block_bytes
        self.allocator_config = allocator_config
        self.model_allocator = model_allocator
        # What counts a trial's bytes: a subclass may also journal its events (the estimate's
        # layer replay, `autotune.engine.emulation.layer_journal`).
        self.make_tracker: Callable[..., LiveBytesTracker] = LiveBytesTracker
        # Untouched CPU buffers standing for the workspaces: counted, never written, so they
        # cost address space only.
        self._workspaces: tuple[torch.Tensor, ...] = ()
        self._kept_free_bytes = 0
        # Where the warm-up left the residents (None: no warm-up yet), and the last tracked
        # trial, which `after_warm_up` takes for the warm-up.
        self.placement: ResidentPlacement | None = None
        self._last_outcome: StepOutcome | None = None
        self.gpu = gpu
        if gpu is not None:
            self.capacity_bytes = gpu.capacity_bytes
            self._workspaces = tuple(
                torch.empty(size, dtype=torch.uint8) for size in gpu.blas_workspace_sizes
            )
            self._kept_free_bytes = gpu.reserve.kernel_workspace_bytes
            # A budget of the caller's own (a MIG slice's capacity) is no catalogue card: it
            # names none, so nothing reads it as that card's (capacity checks, rooflines).
            catalogue = _is_catalogue_budget(gpu)
            label = gpu.gpu.name
            if not catalogue:
                label += f" slice (allocator {format_bytes(gpu.capacity_bytes)})"
            self._info = DeviceInfo(
                kind=DeviceKind.EMULATED,
                name=f"emulated {label} on cpu",
                speed=SpeedSource.CPU_TIMING,
                total_memory_bytes=gpu.gpu.total_memory_bytes,
                capacity_bytes=gpu.capacity_bytes,
                torch_version=torch.__version__,
                gpu=gpu.gpu.name if catalogue else None,
                reserve=gpu.reserve,
                allocator_conf=self._allocator_conf(),
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
            speed=SpeedSource.CPU_TIMING,
            total_memory_bytes=capacity_bytes,
            capacity_bytes=capacity_bytes,
            torch_version=torch.__version__,
            allocator_conf=self._allocator_conf(),
        )

    @property
    def kept_free_bytes(self) -> int:
        """What the step must leave free below the capacity (the named GPU's kernel
        workspaces)."""
        return self._kept_free_bytes

    def _allocator_conf(self) -> str | None:
        return canonical_conf(self.allocator_config) if self.allocator_config else None

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
        holders: Callable[[], MemoryHolders] | None = None,
    ) -> StepOutcome:
        # Attention keeps for backward what a GPU's fused kernel keeps, tracked or timed.
        step = _with_gpu_attention(step)
        if not track:
            oom_phase = run_tracked(step, None)
            return StepOutcome(
                micro_batch=micro_batch,
                fits=oom_phase is None,
                peak_bytes=0,
                phase_peak_bytes={},
                oom_phase=oom_phase,
                series=None,
            )
        limit_bytes = self.capacity_bytes - self._kept_free_bytes
        if not self.model_allocator:
            return self._run_live_bytes(
                step, micro_batch, resident, limit_bytes, record_series, holders
            )
        allocator = CachingAllocator(
            limit_bytes, self.allocator_config, device_total_bytes=self._info.total_memory_bytes
        )
        tracker = self.make_tracker(
            None, allocator=allocator, block_bytes=self.block_bytes, record_series=record_series
        )
        tracker.holders = holders
        placement = self.placement
        residents = self._residents(resident, tracker)

        def resident_then_step() -> object:
            # Inside the tracked run: a resident set the allocator cannot hold is an
            # out-of-memory of this trial like any other.
            tracker.add_resident(residents, placement)
            return step()

        oom_phase = run_tracked(resident_then_step, tracker, micro_batch=micro_batch)
        # The allocator never reserves past its capacity, so a step that completed fits.
        outcome = StepOutcome.of_allocator(
            micro_batch,
            allocator.stats,
            phase_peak_bytes=dict(tracker.phase_peak_bytes),
            oom_phase=oom_phase,
            oom=tracker.oom,
            series=tracker.series if record_series else None,
            allocations=tracker.allocations if record_series else None,
            start=None if placement is None else TrialStart(placement, tracker.resident_events),
        )
        self._last_outcome = outcome
        return outcome

    def _residents(
        self, resident: Iterable[torch.Tensor], tracker: LiveBytesTracker
    ) -> list[torch.Tensor]:
        """What a trial counts before its step: `resident`, and the BLAS workspaces once the
        warm-up placed them. In the warm-up (no `placement` yet) each thread's workspaces are
        allocated at its first matmul instead, among the step's tensors, as the card creates
        that thread's cuBLAS handle then."""
        if self.placement is not None:
            return [*resident, *self._workspaces]
        per_thread = len(self._workspaces) // BLAS_THREADS
        tracker.deferred = {
            backward: list(self._workspaces[thread * per_thread : (thread + 1) * per_thread])
            for thread, backward in enumerate((False, True))
            if per_thread
        }
        tracker.deferred_ops = BLAS_HANDLE_OPS
        return list(resident)

    def after_warm_up(self) -> None:
        """The last tracked trial was the warm-up: keep where it left the residents
        (`keep_placement`)."""
        if self._last_outcome is not None:
            self.keep_placement(self._last_outcome)

    def keep_placement(self, warm_up: StepOutcome) -> None:
        """From now on every trial starts with the residents where `warm_up` (a step from a
        fresh allocator that fitted and recorded its allocations) left them. Only the first
        warm-up places them: on a card a later one finds them placed already, and leaves them
        there."""
        if (
            self.placement is None
            and self.model_allocator
            and warm_up.fits
            and warm_up.start is None
            and warm_up.allocations is not None
        ):
            self.placement = ResidentPlacement(warm_up.allocations)

    def _run_live_bytes(
        self,
        step: Callable[[], object],
        micro_batch: int,
        resident: Iterable[torch.Tensor],
        limit_bytes: int,
        record_series: bool,
        holders: Callable[[], MemoryHolders] | None,
    ) -> StepOutcome:
        tracker = self.make_tracker(
            limit_bytes, block_bytes=self.block_bytes, record_series=record_series
        )
        tracker.holders = holders
        tracker.add_resident(self._residents(resident, tracker))
        oom_phase = run_tracked(step, tracker, micro_batch=micro_batch)
        # The tracker raises before any op takes live bytes past capacity; only a resident
        # set that is already too big can leave a completed step over it.
        fits = oom_phase is None and tracker.peak_bytes <= limit_bytes
        if oom_phase is None and not fits:
            oom_phase = peak_phase(tracker.phase_peak_bytes) or Phase.FORWARD
        return StepOutcome(
            micro_batch=micro_batch,
            fits=fits,
            peak_bytes=tracker.peak_bytes,
            phase_peak_bytes=dict(tracker.phase_peak_bytes),
            oom_phase=oom_phase,
            oom=tracker.oom,
            series=tuple(tracker.series) if record_series and fits else None,
        )

    def synchronize(self) -> None:
        """Nothing to wait for: CPU ops are synchronous."""


def open_device(
    name: str,
    memory_bytes: int | None = None,
    *,
    gpu: str | None = None,
    world_size: int = 1,
    cuda: CudaRuntime | None = None,
    allocator_config: AllocatorConfig | None = None,
) -> Device:
    """The device for a `--device` argument: "cpu" (emulated: `memory_bytes`, or the named `gpu`
    as one of `world_size` ranks sees it), "cuda" or "cuda:N" (where `memory_bytes`, if given,
    caps the capacity). `cuda` is the CUDA runtime a cuda device runs on: torch.cuda when None,
    the simulated backend in tests. `allocator_config`: the caching allocator's settings, which
    the process's environment gives torch (`config_from_environ`, read at the entry point): the
    emulated GPU models them, a CUDA device reports them.

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
        return EmulatedDevice(gpu=budget_for(named, world_size), allocator_config=allocator_config)
    if name == "cpu":
        if memory_bytes is None:
            raise SpecError(
                "--memory: required with the emulated cpu device (the GPU size to emulate, "
                'e.g. --memory 2GiB, or a named GPU: --gpu "H100 80GB")'
            )
        return EmulatedDevice(memory_bytes, allocator_config=allocator_config)
    match = _CUDA_NAME.match(name)
    if match is None:
        raise SpecError(f'device: unknown device {name!r}; use "cpu", "cuda" or "cuda:N"')
    return CudaDevice(
        int(match.group(1) or 0),
        memory_cap_bytes=memory_bytes,
        runtime=cuda,
        allocator_config=allocator_config,
    )
