"""Throughput of one (micro-batch, accumulation) configuration: warm-up, then complete optimizer
steps timed with `time.perf_counter` between two device synchronisations.

Meant for `autotune.engine.training.step.TrainingStep` (any object with its `run(micro_batch,
accumulation_steps)` works). This module imports no torch itself, so the study and its tests
stay torch-free. Out-of-memory is not caught here: the device layer owns it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from autotune.core.schemas import DeviceInfo, SpeedSource

logger = logging.getLogger(__name__)

# Fewer timed steps than this give no usable median or spread, whatever the time budget: the
# recommendation treats speeds within the spread as ties (autotune.core.tuning.ranking), and one
# step has none (a spread of 0.0 made CPU timing noise look like a difference).
MIN_TIMED_STEPS = 3


class OptimizerStepRunner(Protocol):
    """What `measure_throughput` times: `run` performs ONE complete optimizer step over
    `accumulation_steps` micro-batches of `micro_batch` samples (as `TrainingStep.run`)."""

    def run(self, micro_batch: int, accumulation_steps: int) -> object: ...


@dataclass(frozen=True)
class Measurement:
    """Throughput of one configuration on one device (one data-parallel rank).

    `step_time_s` is the median optimizer-step time, `step_time_spread` is (max - min) / median
    of the timed steps. `peak_bytes` is None here; whoever runs the measurement under a memory
    tracker (the device layer) fills it in.
    """

    samples_per_s: float
    tokens_per_s: float | None
    step_time_s: float
    step_time_spread: float
    timed_steps: int
    peak_bytes: int | None
    # Estimated for world_size > 1 (`autotune.core.parallel.overlap`): the step's compute, its
    # communication, and the part of that no compute hides (step_time_s = compute + exposed).
    compute_time_s: float | None = None
    communication_time_s: float | None = None
    exposed_communication_s: float | None = None


def measure_throughput(
    step: OptimizerStepRunner,
    *,
    micro_batch: int,
    accumulation_steps: int,
    synchronize: Callable[[], None],
    tokens_per_sample: int | None,
    target_seconds: float = 1.0,
    warmup_steps: int = 1,
    max_steps: int = 50,
) -> Measurement:
    """Time complete optimizer steps of `step` at one configuration.

    Warm-up steps run first and are not counted (allocator, kernel selection and optimizer
    state settle there). Then steps are timed one by one, each bracketed by `synchronize()`
    (the device's; `torch.cuda.synchronize` on CUDA), until together they take
    `target_seconds` and at least `MIN_TIMED_STEPS` ran (however long one step takes), or
    `max_steps` ran.

    Args:
        step: Runs one optimizer step; set its checkpointing mode before calling.
        micro_batch: Samples per forward/backward.
        accumulation_steps: Micro-batches per optimizer step.
        synchronize: Waits until the device has finished all queued work.
        tokens_per_sample: For token models, to report tokens/s; None otherwise.
        target_seconds: Roughly how long the timed steps should take together.
        warmup_steps: Untimed steps first.
        max_steps: Upper bound on timed steps (tiny models would otherwise run hundreds).

    Returns:
        Samples (and tokens) per second on this device, from the median step time.

    Raises:
        ValueError: on a non-positive size, budget or step count.
        torch.OutOfMemoryError: propagated from the step, as anything else it raises.
    """
    if micro_batch < 1 or accumulation_steps < 1:
        raise ValueError(
            f"micro_batch and accumulation_steps must be >= 1, got "
            f"{micro_batch} and {accumulation_steps}"
        )
    if target_seconds <= 0 or warmup_steps < 0 or max_steps < 1:
        raise ValueError(
            f"need target_seconds > 0, warmup_steps >= 0, max_steps >= 1; got "
            f"{target_seconds}, {warmup_steps}, {max_steps}"
        )
    for _ in range(warmup_steps):
        step.run(micro_batch, accumulation_steps)
    synchronize()  # queued warm-up work must not leak into the first timed step

    step_times_s: list[float] = []
    while len(step_times_s) < max_steps:
        synchronize()
        start = time.perf_counter()
        step.run(micro_batch, accumulation_steps)
        synchronize()
        step_times_s.append(time.perf_counter() - start)
        enough_steps = len(step_times_s) >= MIN_TIMED_STEPS
        if enough_steps and sum(step_times_s) >= target_seconds:
            break

    median_s = statistics.median(step_times_s)
    samples_per_s = micro_batch * accumulation_steps / median_s
    measurement = Measurement(
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * tokens_per_sample if tokens_per_sample else None,
        step_time_s=median_s,
        step_time_spread=(max(step_times_s) - min(step_times_s)) / median_s,
        timed_steps=len(step_times_s),
        peak_bytes=None,
    )
    logger.debug(
        "b=%d G=%d: %.1f samples/s over %d steps (median %.4f s, spread %.2f)",
        micro_batch,
        accumulation_steps,
        samples_per_s,
        measurement.timed_steps,
        median_s,
        measurement.step_time_spread,
    )
    return measurement


# Beside every samples/s timed on the CPU for an emulated GPU of a bare size.
CPU_TIMING = "CPU timing, not a GPU's"


def speed_label(device: DeviceInfo) -> str:
    """Where a device's samples/s come from, as a table or a progress line says it."""
    if device.speed is SpeedSource.MEASURED:
        return "measured"
    if device.speed is SpeedSource.CPU_TIMING:
        return CPU_TIMING
    if device.speed is SpeedSource.ROOFLINE:
        return f"estimated for {device.gpu}"
    return "source not recorded"
