"""Trial runners: where the probe's and the tuner's real training steps run.

`TrialRunner` is the contract the probe and the tuner program against. `InProcessRunner` runs
trials in this process on one model, optimizer and device, kept in steady state: a warm-up step
creates the optimizer state, gradients are freed after each step, and an out-of-memory inside
`optimizer.step()` is undone from a snapshot so parameters are never left half-updated. The
probe worker runs each trial in a fresh child process behind the same contract.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from autotune.core.errors import SpecError
from autotune.core.schemas import DeviceInfo, Phase, Sharding, Spec, StepKind, StepOutcome
from autotune.core.tuning.throughput import Measurement, measure_throughput
from autotune.engine.devices.device import Device
from autotune.engine.training.step import TrainingStep
from autotune.engine.training.workload import Workload, build_workload


class TrialRunner(Protocol):
    """Runs complete training steps of one spec on one device.

    Every method returns out-of-memory as `fits=False` (or a None measurement) and raises
    anything else."""

    @property
    def spec(self) -> Spec: ...

    @property
    def device_info(self) -> DeviceInfo:
        """The device; its capacity is final once `warm_up` has run (a CUDA device reads it
        again once a step's kernels are loaded)."""
        ...

    @property
    def supports_checkpointing(self) -> bool: ...

    @property
    def tokens_per_sample(self) -> int | None: ...

    @property
    def num_blocks(self) -> int | None:
        """Blocks that can be checkpointed one by one (partial checkpointing); None: none."""
        ...

    def warm_up(self, *, checkpointing: bool) -> StepOutcome:
        """One step at micro-batch 1 so the optimizer state exists before any trial."""
        ...

    def trial(
        self,
        micro_batch: int,
        accumulation_steps: int = 1,
        *,
        checkpointing: bool,
        checkpointed_blocks: int | None = None,
    ) -> StepOutcome:
        """One complete optimizer step, tracked (peak, per-op series); with checkpointing, of
        the first `checkpointed_blocks` blocks only when given."""
        ...

    def measure(
        self,
        micro_batch: int,
        accumulation_steps: int,
        *,
        checkpointing: bool,
        target_seconds: float,
        checkpointed_blocks: int | None = None,
    ) -> Measurement | None:
        """Throughput of one configuration with its tracked peak; None when it does not fit."""
        ...

    def check_stop(self) -> None:
        """Raises when the run must stop now (a cancel, a shutdown, a limit), as a step would;
        called by work between steps that may take long (the probe's replay of every size
        below its answer). A runner that is never stopped does nothing."""
        ...


class ForwardingRunner:
    """A `TrialRunner` that forwards everything to `runner`: the base of the runners that wrap
    another one and change part of it."""

    def __init__(self, runner: TrialRunner) -> None:
        self.runner = runner

    @property
    def spec(self) -> Spec:
        return self.runner.spec

    @property
    def device_info(self) -> DeviceInfo:
        return self.runner.device_info

    @property
    def supports_checkpointing(self) -> bool:
        return self.runner.supports_checkpointing

    @property
    def tokens_per_sample(self) -> int | None:
        return self.runner.tokens_per_sample

    @property
    def num_blocks(self) -> int | None:
        return self.runner.num_blocks

    def warm_up(self, *, checkpointing: bool) -> StepOutcome:
        return self.runner.warm_up(checkpointing=checkpointing)

    def trial(
        self,
        micro_batch: int,
        accumulation_steps: int = 1,
        *,
        checkpointing: bool,
        checkpointed_blocks: int | None = None,
    ) -> StepOutcome:
        return self.runner.trial(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            checkpointed_blocks=checkpointed_blocks,
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
        return self.runner.measure(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            target_seconds=target_seconds,
            checkpointed_blocks=checkpointed_blocks,
        )

    def check_stop(self) -> None:
        self.runner.check_stop()


# A step is about to run: its kind, micro-batch, accumulation steps and checkpointing.
StepStartCallback = Callable[[StepKind, int, int, bool], None]


class AnnouncedRunner(ForwardingRunner):
    """`runner`, calling `on_start` before each step it runs, so that a trial of minutes is
    never silent (the CLI's progress)."""

    def __init__(self, runner: TrialRunner, on_start: StepStartCallback) -> None:
        super().__init__(runner)
        self.on_start = on_start

    def warm_up(self, *, checkpointing: bool) -> StepOutcome:
        self.on_start(StepKind.WARM_UP, 1, 1, checkpointing)
        return super().warm_up(checkpointing=checkpointing)

    def trial(
        self,
        micro_batch: int,
        accumulation_steps: int = 1,
        *,
        checkpointing: bool,
        checkpointed_blocks: int | None = None,
    ) -> StepOutcome:
        self.on_start(StepKind.TRIAL, micro_batch, accumulation_steps, checkpointing)
        return super().trial(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            checkpointed_blocks=checkpointed_blocks,
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
        self.on_start(StepKind.MEASURE, micro_batch, accumulation_steps, checkpointing)
        return super().measure(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            target_seconds=target_seconds,
            checkpointed_blocks=checkpointed_blocks,
        )


class InProcessRunner:
    """A `TrialRunner` in this process: one model, optimizer and device."""

    def __init__(
        self,
        spec: Spec,
        device: Device,
        *,
        allowed_factory_prefixes: Sequence[str] | None = None,
        keeps_state: bool = True,
        workload: Workload | None = None,
    ) -> None:
        """`allowed_factory_prefixes`: see `autotune.engine.training.workload.build_factory`.
        `keeps_state`: the session outlives an out-of-memory inside `optimizer.step()`, so the
        warm-up snapshots the model and optimizer state to host memory to undo it. A process
        that exits after one trial passes False: the copy would cost host memory the size of
        the whole training state (18 GB for a 1.5B-parameter model) for nothing.
        `workload`: one built already (a live module, `autotune.python_api`), not from the
        spec's model source.

        Raises:
            SpecError: `sharding: auto`, which no one session runs (before building anything).
        """
        if spec.training.sharding is Sharding.AUTO:
            layouts = ", ".join(s.value for s in Sharding if s.is_layout)
            raise SpecError(
                "training.sharding: auto is the choice the autotune tune command and the "
                "server's runs make by measuring every layout; one session runs one: set one "
                f"of {layouts} (--sharding for a config file)"
            )
        self.spec = spec
        self.device = device
        self.workload = workload or build_workload(
            spec, allowed_factory_prefixes=allowed_factory_prefixes
        )
        self.step = TrainingStep(self.workload, spec.training, device.torch_device)
        self.keeps_state = keeps_state
        self._snapshot: object | None = None

    @property
    def device_info(self) -> DeviceInfo:
        """The device's info, with what the training step itself counts (data parallelism)."""
        info = self.device.info
        if not self.step.assumptions:
            return info
        return info.model_copy(update={"assumptions": [*info.assumptions, *self.step.assumptions]})

    @property
    def supports_checkpointing(self) -> bool:
        return self.workload.set_checkpointing is not None

    @property
    def tokens_per_sample(self) -> int | None:
        return self.workload.tokens_per_sample

    @property
    def num_blocks(self) -> int | None:
        return self.step.num_blocks

    def warm_up(self, *, checkpointing: bool = False) -> StepOutcome:
        """Returns the outcome: when even this does not fit, nothing will."""
        outcome = self.trial(1, checkpointing=checkpointing)
        if outcome.fits:
            self.settle()
        return outcome

    def settle(self) -> None:
        """After a first complete step: the state a warm-up leaves (rebuilt buckets, and the
        snapshot that undoes an out-of-memory inside the optimizer step, and the residents
        where the step left them on the device)."""
        self.device.after_warm_up()
        self.step.settle()
        if self.keeps_state:
            self._snapshot = self.step.snapshot()

    @property
    def has_snapshot(self) -> bool:
        return self._snapshot is not None

    def restore(self) -> None:
        """Back to the state after the warm-up (nothing before it)."""
        if self._snapshot is not None:
            self.step.restore(self._snapshot)

    def trial(
        self,
        micro_batch: int,
        accumulation_steps: int = 1,
        *,
        checkpointing: bool = False,
        checkpointed_blocks: int | None = None,
    ) -> StepOutcome:
        self.step.checkpointing = checkpointing
        self.step.checkpoint_blocks(checkpointed_blocks if checkpointing else None)
        return self._run(
            lambda: self.step.run(micro_batch, accumulation_steps), micro_batch, track=True
        )

    def check_stop(self) -> None:
        """Nothing stops a run in this process but its caller."""

    def measure(
        self,
        micro_batch: int,
        accumulation_steps: int,
        *,
        checkpointing: bool,
        target_seconds: float,
        checkpointed_blocks: int | None = None,
    ) -> Measurement | None:
        # With G > 1 the gradients of earlier micro-batches are alive during later ones, so a
        # step is checked tracked first (it doubles as the warm-up), then timed untracked:
        # the tracker's per-op cost would distort the timing.
        check = self.trial(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            checkpointed_blocks=checkpointed_blocks,
        )
        if not check.fits:
            return None
        measured: list[Measurement] = []
        timed = self._run(
            lambda: measured.append(
                measure_throughput(
                    self.step,
                    micro_batch=micro_batch,
                    accumulation_steps=accumulation_steps,
                    synchronize=self.device.synchronize,
                    tokens_per_sample=self.workload.tokens_per_sample,
                    target_seconds=target_seconds,
                    warmup_steps=0,
                )
            ),
            micro_batch,
            track=False,
        )
        if not timed.fits:
            return None
        return replace(measured[0], peak_bytes=check.peak_bytes)

    def _run(self, work: Callable[[], object], micro_batch: int, *, track: bool) -> StepOutcome:
        # A step that completed its synchronised backward but ran out in the optimizer (a
        # failed warm-up's) leaves DDP's reducer due to rebuild its buckets before the next
        # forward: done here, between steps, as `settle` does after a warm-up. Inside the step
        # the resident list below would keep the old buckets alive beside the new ones, which
        # a rank's reducer frees before it makes them (docs/design.md#data-parallel).
        self.step.settle()
        outcome = self.device.run_trial(
            work,
            micro_batch=micro_batch,
            resident=self.step.resident_tensors(),
            record_series=track,
            track=track,
            holders=self.step.memory_holders,
        )
        if not outcome.fits:
            self.step.clear_grads()
            if outcome.oom_phase is Phase.OPTIMIZER:
                if self._snapshot is not None:
                    # Some parameters may already be updated; put all of them back as one.
                    self.step.restore(self._snapshot)
                else:
                    # No step has completed: the optimizer's state may be half built.
                    self.step.reset_optimizer()
        return outcome
