"""The real probe's first fit points, traced instead of run: the same training step at two
micro-batches on fake tensors (`autotune.engine.estimate`), on a model of the device the probe
runs on.

A real trial costs seconds to minutes on a GPU worker (a child process, the model loaded, a warm-up
step); a trace of the same step costs no kernel and no memory. Given two traced steps, the search
(`autotune.core.search.micro_batch`) predicts the answer before any real trial and verifies it with
two: the answer fits, the next size does not (docs/design.md#cheaper-real-probes). The trace is
evidence, never an answer: when it disagrees with the trials, the search goes on from real fit
points, as it would without it.

A trace that cannot be made (a model that reads tensor values in its step, Adafactor, a factory
that fails under fake tensors) leaves the probe as it was, with a warning: it only ever costs
the trials it would have saved. fp16 is traced as bf16 (the same tensors but its gradient
scaler's few bytes): a near fit, which the trials verify.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from autotune.core.errors import SpecError
from autotune.core.gpus.catalogue import UnknownGpu, find_gpu
from autotune.core.gpus.cuda_reserve import GpuBudget, budget_for
from autotune.core.memory.allocator_config import parse_alloc_conf
from autotune.core.schemas import DeviceInfo, DeviceKind, Precision, Spec, StepOutcome
from autotune.engine.estimate import EstimateRunner
from autotune.engine.runner import TrialRunner

logger = logging.getLogger(__name__)

# The sizes traced: the search's own fit points (b = 1 runs another op sequence).
FIT_POINT_MICRO_BATCHES = (2, 3)


def tracer_for(
    spec: Spec, device: DeviceInfo, *, allowed_factory_prefixes: Sequence[str] | None = None
) -> EstimateRunner:
    """An `EstimateRunner` on the model of `device` the emulated GPU has: a catalogue GPU's
    (the one it emulates, or the CUDA card's own by its name) with its BLAS workspaces resident
    in the allocator and kernel scratch kept free, on the device's capacity; else the bare
    capacity. With the device's caching-allocator settings either way. What the trace cannot
    see of a card (its libraries' other memory) is what the trials will show."""
    allocator_config = parse_alloc_conf(device.allocator_conf) if device.allocator_conf else None
    budget = _catalogue_budget(device, spec.training.world_size)
    return EstimateRunner(
        spec,
        gpu=budget,
        capacity_bytes=None if budget is not None else device.capacity_bytes,
        allocator_config=allocator_config,
        allowed_factory_prefixes=_listed(allowed_factory_prefixes),
    )


def _catalogue_budget(device: DeviceInfo, world_size: int) -> GpuBudget | None:
    """The catalogue GPU of `device` as one rank sees it, on the device's own capacity."""
    if device.kind is DeviceKind.EMULATED:
        name = device.gpu
    elif device.kind is DeviceKind.CUDA:
        name = device.name
    else:
        name = None
    if name is None:
        return None
    try:
        budget = budget_for(find_gpu(name), world_size)
    except UnknownGpu:
        return None
    if budget.capacity_bytes == device.capacity_bytes:
        return budget
    # A card's capacity is what it measured (another process on it, a MIG slice, a cap): the
    # same card's workspaces on that capacity.
    total_bytes = device.capacity_bytes + budget.reserve.outside_allocator_bytes
    return replace(budget, gpu=replace(budget.gpu, total_memory_bytes=total_bytes))


def _listed(prefixes: Sequence[str] | None) -> list[str] | None:
    return None if prefixes is None else list(prefixes)


def trace_fit_points(
    spec: Spec,
    device: DeviceInfo,
    *,
    modes: Sequence[bool],
    allowed_factory_prefixes: Sequence[str] | None = None,
) -> dict[bool, list[StepOutcome]]:
    """The step traced at `FIT_POINT_MICRO_BATCHES` (up to the spec's cap) in each checkpointing
    mode of `modes`, after a warm-up as the probe does; {} when it cannot be traced (logged)."""
    sizes = [b for b in FIT_POINT_MICRO_BATCHES if b <= spec.training.max_micro_batch]
    if len(sizes) < 2 or not modes:
        return {}
    if spec.training.precision is Precision.FP16:
        # fp16's gradient scaler reads whether the gradients overflowed, which a fake tensor
        # cannot say; bf16 holds the same tensors but the scaler's few bytes (three blocks on
        # gpt2-tiny): near enough for a first fit, which the trials verify.
        bf16 = spec.training.model_copy(update={"precision": Precision.BF16})
        spec = spec.model_copy(update={"training": bf16})
    try:
        tracer = tracer_for(spec, device, allowed_factory_prefixes=allowed_factory_prefixes)
        if not any(tracer.warm_up(checkpointing=mode).fits for mode in modes):
            return {}
        return {mode: [tracer.trial(size, checkpointing=mode) for size in sizes] for mode in modes}
    except SpecError as error:
        logger.warning("the fit points are run, not traced: %s", error)
    except Exception as error:  # noqa: BLE001 - a trace only saves trials; the trials decide
        logger.warning(
            "the fit points are run, not traced: tracing the step on fake tensors failed (%s: %s)",
            type(error).__name__,
            error,
        )
    return {}


class TracedFitPoints:
    """A probe's `FitTracer` in this process: traces both modes once, on the session's device
    as it is after the warm-up (a CUDA device's capacity is final then). The factories it may
    import are as `autotune.engine.training.workload.build_factory`'s (None: any, as the CLI runs
    the user's own)."""

    def __init__(
        self, session: TrialRunner, *, allowed_factory_prefixes: Sequence[str] | None = None
    ) -> None:
        self.session = session
        self.allowed_factory_prefixes = allowed_factory_prefixes
        self._traced: dict[bool, list[StepOutcome]] | None = None

    def fit_points(self, *, checkpointing: bool) -> list[StepOutcome]:
        if self._traced is None:
            modes = [False, True] if self.session.supports_checkpointing else [False]
            self._traced = trace_fit_points(
                self.session.spec,
                self.session.device_info,
                modes=modes,
                allowed_factory_prefixes=self.allowed_factory_prefixes,
            )
        return self._traced.get(checkpointing, [])


__all__ = ["FIT_POINT_MICRO_BATCHES", "TracedFitPoints", "trace_fit_points", "tracer_for"]
