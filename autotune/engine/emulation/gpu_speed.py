"""Throughput on an emulated named GPU: the roofline of the traced step on that GPU, not the
host CPU's timing of the emulated one.

The emulated GPU runs the real step on the CPU, which says exactly what fits (memory is the
emulated GPU's own accounting) and nothing about how fast an H100 would run it: ranking
configurations by the CPU's samples/s would pick what suits the host. So on an emulated *named*
GPU every measurement keeps the real step's memory check and takes its speed from the same step
traced on fake tensors and timed by roofline on that GPU (`autotune.engine.estimate`), the
estimate's speed. On an emulated GPU of a bare size there is no GPU to be fast or slow: its
samples/s stay CPU timings, and its device says so (`DeviceInfo.speed`), as does a named GPU's
when the step cannot be traced (fp16's gradient scaler, a factory that reads values), with a
warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.roofline import RooflineAssumptions
from autotune.core.schemas import DeviceInfo, DeviceKind, SpeedSource
from autotune.core.tuning.throughput import Measurement
from autotune.engine.estimate import EstimateRunner, check_traceable
from autotune.engine.fit_points import tracer_for
from autotune.engine.runner import ForwardingRunner, TrialRunner

logger = logging.getLogger(__name__)


class RooflineTimedRunner(ForwardingRunner):
    """A `TrialRunner` on an emulated named GPU whose measurements are the roofline's: the
    trials, warm-up and each measurement's memory check run on `runner` as they are; the step
    time is the traced step's on the GPU, with its recompute when checkpointing."""

    def __init__(self, runner: TrialRunner, estimate: EstimateRunner) -> None:
        """`estimate`: the same step on fake tensors on the same GPU, warmed up."""
        info = runner.device_info
        if info.kind is not DeviceKind.EMULATED or info.gpu is None:
            raise ValueError(f"a roofline needs an emulated named GPU, not {info.name!r}")
        super().__init__(runner)
        self.estimate = estimate
        self.gpu = find_gpu(info.gpu)
        self.assumptions = RooflineAssumptions()

    @property
    def device_info(self) -> DeviceInfo:
        info = self.runner.device_info
        speed = (
            f"samples/s are not this host's: {self.assumptions.describe(self.gpu)} (the step "
            "traced on fake tensors); the emulated step runs on the CPU for its memory only"
        )
        communication = self.estimate.communication_assumption
        lines = [speed] if communication is None else [speed, communication]
        return info.model_copy(
            update={"assumptions": [*info.assumptions, *lines], "speed": SpeedSource.ROOFLINE}
        )

    def measure(
        self,
        micro_batch: int,
        accumulation_steps: int,
        *,
        checkpointing: bool,
        target_seconds: float,
        checkpointed_blocks: int | None = None,
    ) -> Measurement | None:
        """The configuration's roofline throughput on the GPU, with the peak of the real step;
        None when the real step does not fit. Nothing is timed (`target_seconds` is unused)."""
        del target_seconds
        check = self.trial(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            checkpointed_blocks=checkpointed_blocks,
        )
        if not check.fits:
            return None
        return self.estimate.roofline_measurement(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            peak_bytes=check.peak_bytes,
            checkpointed_blocks=checkpointed_blocks,
        )


def timed_on_its_gpu(
    runner: TrialRunner, *, allowed_factory_prefixes: Sequence[str] | None = None
) -> TrialRunner:
    """`runner` with roofline measurements when its device is an emulated named GPU; as it is
    on a real GPU (measured), an emulated GPU of a bare size (CPU timings), or when the step
    cannot be traced (CPU timings, with a warning). Tracing the warm-up costs a fake model's
    build, about a second; `allowed_factory_prefixes` as `autotune.engine.fit_points`'s."""
    info = runner.device_info
    if info.kind is not DeviceKind.EMULATED or info.gpu is None:
        return runner
    try:
        check_traceable(runner.spec)
        estimate = tracer_for(runner.spec, info, allowed_factory_prefixes=allowed_factory_prefixes)
        # Warmed up so that its optimizer state exists: a timed step does not create it.
        if not any(estimate.warm_up(checkpointing=mode).fits for mode in (False, True)):
            return runner  # nothing fits: nothing will be measured
    except Exception as error:  # noqa: BLE001 - without a trace the CPU times it, and says so
        logger.warning(
            "samples/s on %s are CPU timings of the emulated step: the step cannot be traced "
            "for its roofline (%s: %s)",
            info.gpu,
            type(error).__name__,
            error,
        )
        return runner
    return RooflineTimedRunner(runner, estimate)


__all__ = ["RooflineTimedRunner", "timed_on_its_gpu"]
