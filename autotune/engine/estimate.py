"""Estimates without a GPU: a training step traced on fake tensors on an emulated named GPU.

`EstimateRunner` is a `TrialRunner` whose model, optimizer state and inputs are fake tensors
(`FakeTensorMode`: shapes, dtypes and strides, no storage, no arithmetic), so a step of a model
of any size costs seconds and no memory. Every trial runs the emulated GPU's own code path, the
live-byte tracker, the caching-allocator model, CUDA's autocast policy, the fused attention
kernels and the named GPU's reserve, on those fake tensors: an estimate and an emulated probe
agree by construction, and the same search, recommendation and tuner run on top
(docs/design.md#estimates-without-a-gpu).

Speed is the roofline of every kernel of one step on the named GPU (`autotune.core.gpus.roofline`):
FLOPs from torch's formulas (`torch.utils.flop_counter`), bytes read and written from the
shapes, and the stated efficiencies. Attention is counted as the fused kernel: SDPA runs as the
CPU's flash kernel, whose FLOP formulas are torch's SDPA formulas, in a pass of its own.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from autotune.core.errors import SpecError
from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import GpuBudget, budget_for
from autotune.core.gpus.roofline import RooflineAssumptions
from autotune.core.memory.allocator_config import AllocatorConfig
from autotune.core.memory.resident_placement import ResidentPlacement
from autotune.core.parallel.layouts import layout_transfers
from autotune.core.parallel.overlap import OverlapAssumptions, StepTimes, step_times
from autotune.core.parallel.topology import Topology, topology_for
from autotune.core.schemas import (
    DeviceInfo,
    DeviceKind,
    OptimizerName,
    Precision,
    Spec,
    SpeedSource,
    StepOutcome,
)
from autotune.core.tuning.throughput import Measurement
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.emulation.layer_journal import NotReplayable
from autotune.engine.kernel_times import KernelTimes, SpeedPass
from autotune.engine.replay.layer_plan import shared_shallow_blocks
from autotune.engine.replay.layer_replay import PARTIAL_TRACED_LAYERS, LayerReplay, replay_depth
from autotune.engine.replay.layer_speed import LayerKernelTimes, step_times_s
from autotune.engine.runner import InProcessRunner
from autotune.engine.trace_mode import TraceMode
from autotune.engine.training.sharding import model_parameters

logger = logging.getLogger(__name__)


class _Interruptible(TorchFunctionMode):
    """Calls `check` every `_CHECK_EVERY_OPS` torch calls of a build or a trace: building or
    tracing a large model takes minutes, and a cancel, a shutdown or a limit must stop it within
    seconds (`check` raises to stop).

    Where `check` may raise matters. A build runs no autograd, so it checks at the torch call
    that is due. A trace checks at the first module call once one is due (a module forward
    pre-hook): there the exception crosses only Python frames, or the autograd engine when a
    checkpointed block is recomputed in backward, which passes it on. Raised from a torch call
    of a trace, it could come from a call that C++ makes back into Python, through a frame that
    cannot pass it on: a checkpoint's hook saving a fused attention's tensors reads their shapes
    (torch calls), and the worker aborted ("Fatal Python error: Aborted", in make test).

    A stop is final: once `check` raised, the next check point raises it again instead of
    checking, and leaving the mode raises it whatever happened meanwhile. Code between here and
    the check may catch it (a model's own `try`, a library that turns any error into its own,
    as the build does with a config's ValueError), and the stop must neither be lost nor
    reported as that code's error. The call with which a `no_grad()` being left restores grad
    mode is never a check point: grad mode then stayed off for the rest of the process.
    """

    def __init__(self, check: Callable[[], None], *, at_modules: bool) -> None:
        super().__init__()
        self.check = check
        self.at_modules = at_modules
        self.ops = 0
        self.due = False
        self.stop: BaseException | None = None
        self._owner = threading.get_ident()
        self._hook: RemovableHandle | None = None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops += 1
        if self.ops % _CHECK_EVERY_OPS == 0:
            if self.at_modules:
                self.due = True
            elif func is not torch._C._set_grad_enabled:
                self._check_point()
        return func(*args, **(kwargs or {}))

    def _before_module(self, module: torch.nn.Module, args: Any) -> None:
        # The hook is global: other threads' modules (another test, a server) are not ours.
        if self.due and threading.get_ident() == self._owner:
            self.due = False
            self._check_point()

    def _check_point(self) -> None:
        if self.stop is not None:
            raise self.stop
        try:
            self.check()
        except BaseException as stop:
            self.stop = stop
            raise

    def __enter__(self) -> _Interruptible:
        if self.at_modules:
            self._hook = register_module_forward_pre_hook(self._before_module)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)  # type: ignore[no-untyped-call]
        if self._hook is not None:
            self._hook.remove()
        stop = self.stop
        if stop is not None and exc_info[1] is not stop:
            raise stop.with_traceback(None) from exc_info[1]


@contextmanager
def _sequences_not_packed() -> Iterator[None]:
    """transformers decides whether a batch packs several sequences by reading the position
    ids' values, which fake tensors do not have; it then builds an explicit (b, 1, s, s) mask
    that the real step, whose position ids count up, never builds. The estimate's batches are
    never packed, so the answer is known: say so for the duration of a trial."""
    try:
        masking_utils = importlib.import_module("transformers.masking_utils")
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # a transformers without packed-sequence detection
        yield
        return
    setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)  # noqa: B010
    try:
        yield
    finally:
        setattr(masking_utils, "find_packed_sequence_indices", original)  # noqa: B010


@dataclass(frozen=True)
class _TrialKey:
    """What a traced step depends on once the runner is warm (the spec is the runner's)."""

    micro_batch: int
    accumulation_steps: int
    checkpointing: bool
    checkpointed_blocks: int | None


def _trial_key(
    micro_batch: int, accumulation_steps: int, checkpointing: bool, checkpointed_blocks: int | None
) -> _TrialKey:
    # Blocks count only while checkpointing (the step ignores them otherwise).
    blocks = checkpointed_blocks if checkpointing else None
    return _TrialKey(micro_batch, accumulation_steps, checkpointing, blocks)


@dataclass(frozen=True)
class _StepTimes:
    """A traced step's roofline time, and that of its middle micro-step (0 with fewer than
    three), from a step of `micro_steps` micro-steps."""

    total_s: float
    middle_s: float
    micro_steps: int


def check_traceable(spec: Spec) -> None:
    """Refuse what reads tensor values inside a step: fake tensors have none."""
    training = spec.training
    if training.optimizer is OptimizerName.ADAFACTOR:
        raise SpecError(
            "training.optimizer: adafactor reads values inside its step (its step count, the "
            "parameters' norms), which an estimate cannot trace; estimate with adamw or sgd"
        )
    if training.precision is Precision.FP16:
        raise SpecError(
            "training.precision: fp16's gradient scaler reads whether the gradients "
            "overflowed, which an estimate cannot trace; bf16 holds the same tensors"
        )


# A trial traces at most this many micro-steps: the middle ones allocate nothing the first did
# not, so the peak of more is the peak of these (`EstimateRunner.trial`).
_TRACED_ACCUMULATION = 5
# The speed pass traces at most this many: a first, a middle and a last micro-step, the middle
# one's time standing for every other (`EstimateRunner.step_time_s`); as many as the trial
# where a trial's step is not written out from 3 (`EstimateRunner._timed_micro_steps`).
_TIMED_ACCUMULATION = 3
_CHECK_EVERY_OPS = 64


def estimate_info(
    emulated: DeviceInfo,
    gpu: GpuBudget | None,
    assumptions: RooflineAssumptions,
    communication: str | None = None,
) -> DeviceInfo:
    """The device an estimate reports: the emulated GPU's `emulated` info, marked as traced, with
    the roofline's assumptions when there is a named `gpu` to be fast or slow, and how
    `communication` between ranks is estimated when there are several."""
    name = gpu.gpu.name if gpu is not None else emulated.name.removeprefix("emulated ")
    speed = [assumptions.describe(gpu.gpu)] if gpu is not None else []
    if gpu is not None and communication is not None:
        speed.append(communication)
    return emulated.model_copy(
        update={
            "kind": DeviceKind.ESTIMATE,
            "name": f"estimate for {name}",
            "speed": SpeedSource.ROOFLINE if gpu is not None else None,
            "assumptions": [
                "estimated: the step was traced on fake tensors (shapes only); no kernel "
                "ran and no memory was allocated",
                *emulated.assumptions,
                *speed,
            ],
        }
    )


def estimate_device(
    gpu_name: str, *, world_size: int = 1, allocator_config: AllocatorConfig | None = None
) -> DeviceInfo:
    """What an estimate for the named GPU reports as its device, before any spec (a worker's
    inventory): as `EstimateRunner(spec, gpu=...).device_info` for a spec of `world_size`."""
    budget = budget_for(find_gpu(gpu_name), world_size)
    emulated = EmulatedDevice(None, gpu=budget, allocator_config=allocator_config).info
    return estimate_info(emulated, budget, RooflineAssumptions())


class EstimateRunner:
    """A `TrialRunner` on fake tensors on an emulated named GPU: nothing is allocated and no
    kernel runs. Trials report what the emulated GPU would; `measure` reports the roofline
    speed on the named GPU, not a timing."""

    def __init__(
        self,
        spec: Spec,
        *,
        gpu: GpuBudget | None = None,
        capacity_bytes: int | None = None,
        allocator_config: AllocatorConfig | None = None,
        assumptions: RooflineAssumptions | None = None,
        allowed_factory_prefixes: list[str] | None = None,
        interrupt: Callable[[], None] | None = None,
        layer_replay: bool = True,
    ) -> None:
        """The emulated GPU to estimate for: a named `gpu` (memory and speed) or a bare
        `capacity_bytes` (memory only: a speed needs the card's peaks), with the caching
        allocator's settings (torch's defaults when None). `interrupt` is called often while
        the model is built and traced (every few dozen operations) and raises to stop the
        estimate: a stop while building raises from here. `layer_replay=False` traces every
        trial's whole model, never a shallow one replayed (the replay's tests compare the two)."""
        check_traceable(spec)
        self.spec = spec
        self._interrupt = interrupt
        self._mode = TraceMode(allow_non_fake_inputs=True)
        self.gpu = gpu
        self.assumptions = assumptions or RooflineAssumptions()
        self._allowed_factory_prefixes = allowed_factory_prefixes
        # A decoder of identical layers is traced at a few layers and replayed at its depth
        # (`autotune.engine.replay.layer_replay`); anything else, or `layer_replay=False`, is
        # traced whole. Read on the meta device, outside the fake mode, from the model built
        # whole there: seconds at thousands of layers, so checked as a build is (the read
        # returns None on any error of the build; a stop is raised as the check leaves).
        with self._checked(at_modules=False):
            depth = replay_depth(spec) if layer_replay else None
        self._replay: LayerReplay | None = None
        # Partial checkpointing's replay, from a deeper traced model, built when first needed
        # (`_replay_of`); None for good once it cannot be.
        self._partial: LayerReplay | None = None
        self._partial_possible = depth is not None and depth >= PARTIAL_TRACED_LAYERS
        self._full: InProcessRunner | None = None
        # Building a model of thousands of layers takes minutes too: checked as a trace is.
        with self._mode, self._checked(at_modules=False):
            self._device = EmulatedDevice(
                capacity_bytes, gpu=gpu, allocator_config=allocator_config
            )
            if depth is not None:
                try:
                    self._replay = LayerReplay(
                        spec,
                        self._device,
                        depth,
                        allowed_factory_prefixes=allowed_factory_prefixes,
                    )
                except NotReplayable:
                    self._replay = None
            if self._replay is None:
                self._full = self._build_full()
        self.overlap = OverlapAssumptions()
        self.topology: Topology | None = (
            topology_for(spec.training, gpu.gpu)
            if gpu is not None and spec.training.world_size > 1
            else None
        )
        # Traced trials and speed passes once the runner is warm, by what was traced: after a
        # warm-up a trial starts from the same state whatever ran before (gradients freed, an
        # optimizer step that ran out undone from the snapshot) and the residents where the
        # first warm-up left them, so the same trial traces the same outcome. The tuner asks
        # for many again (the probe's sizes, the G = 2 probe's, its measurements of them).
        self._warm = False
        self._warm_checkpointing = False
        # Where the residents were as the last warm-up started (None: before the first).
        self._warm_placement: ResidentPlacement | None = None
        self._warm_outcome: StepOutcome | None = None
        self._outcomes: dict[_TrialKey, StepOutcome] = {}
        self._step_times: dict[_TrialKey, _StepTimes] = {}
        # Once warm, the traced models' speed passes by traced depth and shallow step: partial
        # checkpointing's counts mostly share one shallow step (`LayerReplay.plan`), each timed
        # from its kernels by its own plan.
        self._layered: dict[tuple[int, _TrialKey], LayerKernelTimes] = {}
        # Speed passes by the layer replay while they can be (`autotune.engine.replay.layer_speed`;
        # ZeRO-1's optimizer kernels with the deep rank's partition); `layer_replay=False`
        # times the whole model too.
        self._speed_replay = True
        self._partial_speed_replay = True

    def _build_full(self) -> InProcessRunner:
        # The snapshot that undoes an out-of-memory inside the optimizer step is fake too:
        # it costs nothing, and it keeps the state a trial starts from the emulated GPU's.
        return InProcessRunner(
            self.spec,
            self._device,
            allowed_factory_prefixes=self._allowed_factory_prefixes,
        )

    @property
    def _runner(self) -> InProcessRunner:
        """The whole model's runner. With the layer replay it is built only when a trial or a
        speed pass needs the whole model (one the replay cannot vouch for, or partial
        checkpointing before a warm-up), and then warmed up as the replayed warm-up was, so
        that it starts from the same state."""
        if self._full is None:
            # A build is checked at torch calls, a trace at module calls (`_Interruptible`).
            with self._mode, _sequences_not_packed(), self._checked(at_modules=False):
                full = self._build_full()
            if self._warm:
                with self._mode, _sequences_not_packed(), self._checked():
                    warm = full.warm_up(checkpointing=self._warm_checkpointing)
                if not warm.fits:
                    raise RuntimeError(
                        "estimate: the whole model's warm-up ran out of memory where the "
                        "layer replay's did not"
                    )
            self._full = full
        return self._full

    def _stop_replay(self, reason: NotReplayable) -> None:
        """The shallow journal did not show the structure the replay needs: from now on every
        trial is traced whole (the whole model warms up as the replay did, if it had)."""
        logger.info("estimate: tracing the whole model: %s", reason)
        self._replay = None

    def _stop_partial_replay(self, reason: NotReplayable) -> None:
        """As `_stop_replay`, for partial checkpointing's trials and speed passes only."""
        logger.info("estimate: tracing partial checkpointing whole: %s", reason)
        self._partial = None
        self._partial_possible = False

    def _replay_of(self, blocks: int | None) -> LayerReplay | None:
        """The layer replay of a step that checkpoints the first `blocks` layers (None: all, or
        no checkpointing), or None when it is traced whole. Partial checkpointing's replay
        traces `PARTIAL_TRACED_LAYERS` layers
        (`autotune.engine.replay.layer_plan.partial_plan`); it
        is built when first needed and warmed up as the replay was (its warm-up must find
        what the replay's did), and only once the estimate is warm: a cold step starts from
        whatever the steps before it left, which the other traced model ran."""
        replay = self._replay
        if replay is None or blocks is None or blocks == replay.depth:
            return replay
        if not (self._partial_possible and self._warm and 1 <= blocks < replay.depth):
            return None
        if self._partial is None:
            try:
                with self._mode, self._checked(at_modules=False):
                    partial = LayerReplay(
                        self.spec,
                        self._device,
                        replay.depth,
                        traced_layers=PARTIAL_TRACED_LAYERS,
                        allowed_factory_prefixes=self._allowed_factory_prefixes,
                    )
                self._partial = partial
                self._warm_partial()
            except NotReplayable as reason:
                self._stop_partial_replay(reason)
        return self._partial

    def _warm_partial(self) -> None:
        """Warms partial checkpointing's replay up as the replay was.

        Raises:
            NotReplayable: its warm-up is not the replay's.
        """
        assert self._partial is not None
        with self._mode, _sequences_not_packed(), self._checked():
            outcome = self._partial.warm_up(
                checkpointing=self._warm_checkpointing, placement=self._warm_placement
            )
        if outcome != self._warm_outcome:
            raise NotReplayable("the two traced models' warm-ups differ")

    @property
    def layer_replay(self) -> bool:
        """Whether trials are replayed from a shallow model's trace."""
        return self._replay is not None

    @property
    def speed_replay(self) -> bool:
        """Whether speed passes are timed from a shallow one "
        "(`autotune.engine.replay.layer_speed`)."""
        return self._replay is not None and self._speed_replay

    @property
    def partial_replay(self) -> bool:
        """Whether partial checkpointing's trials are replayed (its traced model is built)."""
        return self._replay is not None and self._partial is not None

    @property
    def partial_speed_replay(self) -> bool:
        """Whether partial checkpointing's speed passes are timed from its traced model."""
        return self.partial_replay and self._partial_speed_replay

    @property
    def communication_assumption(self) -> str | None:
        """How the step's communication is estimated; None with one rank (there is none)."""
        return None if self.topology is None else self.overlap.describe(self.topology)

    @property
    def _any_runner(self) -> InProcessRunner:
        """A runner of this spec, for what does not depend on the depth (the shallow model's
        with the replay: its device reports the emulated GPU, its step the same assumptions)."""
        return self._replay.runner if self._replay is not None else self._runner

    @property
    def device_info(self) -> DeviceInfo:
        return estimate_info(
            self._any_runner.device_info,
            self.gpu,
            self.assumptions,
            self.communication_assumption,
        )

    def communication(self, compute_s: float, accumulation_steps: int) -> StepTimes | None:
        """The step's communication beside `compute_s` of compute, as the spec's layout issues
        it on its topology (`autotune.core.parallel`); None with one rank."""
        if self.topology is None:
            return None
        # With the layer replay, the deep model's from the shallow one's: no whole model built.
        model = (
            self._replay.model_parameters()
            if self._replay is not None
            else model_parameters(self._runner.step.model)
        )
        transfers = layout_transfers(self.spec.training, model, self.topology)
        return step_times(
            transfers,
            self.topology,
            compute_s=compute_s,
            accumulation_steps=accumulation_steps,
            assumptions=self.overlap,
        )

    @property
    def supports_checkpointing(self) -> bool:
        return self._any_runner.supports_checkpointing

    @property
    def tokens_per_sample(self) -> int | None:
        return self._any_runner.tokens_per_sample

    @property
    def num_blocks(self) -> int | None:
        if self._replay is not None:
            # The shallow model's blocks are its layers (LayerReplay checked): one per layer.
            return self._replay.depth
        return self._runner.num_blocks

    def _checked(self, *, at_modules: bool = True) -> contextlib.AbstractContextManager[object]:
        """Stops on `interrupt`: at module calls in a trace, at torch calls in a build
        (`_Interruptible`)."""
        if self._interrupt is None:
            return contextlib.nullcontext()
        return _Interruptible(self._interrupt, at_modules=at_modules)

    def check_stop(self) -> None:
        """The estimate's `interrupt`, as a build or a trace checks it."""
        if self._interrupt is not None:
            self._interrupt()

    def warm_up(self, *, checkpointing: bool = False) -> StepOutcome:
        self._outcomes.clear()
        self._step_times.clear()
        self._layered.clear()
        self._warm_checkpointing = checkpointing
        self._warm_placement = self._device.placement
        with self._mode, _sequences_not_packed(), self._checked():
            outcome = None
            if self._replay is not None:
                try:
                    outcome = self._replay.warm_up(checkpointing=checkpointing)
                except NotReplayable as reason:
                    self._stop_replay(reason)
                # A whole model built before (a trial the replay could not vouch for) warms
                # up too.
                if outcome is not None and self._full is not None:
                    self._full.warm_up(checkpointing=checkpointing)
            if outcome is None:
                outcome = self._runner.warm_up(checkpointing=checkpointing)
        self._warm = outcome.fits
        self._warm_outcome = outcome
        if self._partial is not None and self._replay is not None:
            try:
                self._warm_partial()
            except NotReplayable as reason:
                self._stop_partial_replay(reason)
        return outcome

    def trial(
        self,
        micro_batch: int,
        accumulation_steps: int = 1,
        *,
        checkpointing: bool = False,
        checkpointed_blocks: int | None = None,
    ) -> StepOutcome:
        """The traced step. A long accumulation is traced as `_TRACED_ACCUMULATION` micro-steps:
        the middle ones allocate nothing the first did not (gradients accumulate in place), so
        the peak of more is the peak of these, and `accumulation_steps` of 2^40 costs what 5
        do (each traced micro-step of a large model costs seconds, and its records memory).
        Once warm, a trial traced before is answered from its first trace."""
        key = _trial_key(
            micro_batch,
            min(accumulation_steps, _TRACED_ACCUMULATION),
            checkpointing,
            checkpointed_blocks,
        )
        known = self._outcomes.get(key)
        if known is not None:
            return known
        replay = self._replay_of(key.checkpointed_blocks)
        outcome: StepOutcome | None = None
        if replay is not None:
            # Partial checkpointing's trials of 2 micro-steps are the tuner's fewest-blocks
            # search (`autotune.engine.tuner`), and the count it finds is measured next, a
            # step of 3 or more micro-steps whose trial and speed pass trace the shallow step
            # of 3 (`_timed_along`), which the search's counts mostly share (`partial_plan`):
            # so the search traces that step, with its speed pass along, and writes it out
            # for 2 (`LayerReplay.trial`). The measurement then traces nothing. (A measurement
            # of 2 micro-steps times its own step along already.) A count near either end has
            # a shallow step of its own, and the search reaches such counts mostly on its way
            # to checkpointing every block, where nothing partial is measured: their trials
            # trace their 2.
            ahead = (
                replay is self._partial
                and key.accumulation_steps == 2
                and replay.writes_out_micro_steps
                and not replay.timing_along
                and replay.plan(key.checkpointed_blocks)[1]
                == shared_shallow_blocks(replay.traced_layers)
            )
            try:
                with (
                    self._timed_along(
                        micro_batch, _TIMED_ACCUMULATION, checkpointing, key.checkpointed_blocks
                    )
                    if ahead
                    else contextlib.nullcontext()
                ):
                    with self._mode, _sequences_not_packed(), self._checked():
                        outcome = replay.trial(
                            micro_batch,
                            key.accumulation_steps,
                            checkpointing=checkpointing,
                            checkpointed_blocks=key.checkpointed_blocks,
                            from_three=ahead,
                        )
            except NotReplayable as reason:
                if replay is self._partial:
                    self._stop_partial_replay(reason)
                else:
                    self._stop_replay(reason)
        if outcome is None:
            runner = self._runner
            with self._mode, _sequences_not_packed(), self._checked():
                outcome = runner.trial(
                    micro_batch,
                    key.accumulation_steps,
                    checkpointing=checkpointing,
                    checkpointed_blocks=checkpointed_blocks,
                )
        if self._warm:
            self._outcomes[key] = outcome
        return outcome

    def step_time_s(
        self,
        micro_batch: int,
        accumulation_steps: int = 1,
        *,
        checkpointing: bool = False,
        checkpointed_blocks: int | None = None,
    ) -> float:
        """The roofline time of one optimizer step on the named GPU (its recompute included
        when checkpointing).

        A step's middle micro-steps run the same kernels (gradients accumulate; only the first
        allocates them and only the last synchronises ranks), so a longer accumulation is
        traced as 3 micro-steps, the time of the middle one standing for each of the
        `accumulation_steps` - 3 others: any accumulation costs three traced micro-steps (an
        8B model traces one in seconds)."""
        if self.gpu is None:
            raise SpecError("estimate: a speed needs a named GPU (--estimate NAME), not a size")
        key = _trial_key(
            micro_batch,
            self._timed_micro_steps(accumulation_steps, checkpointed_blocks),
            checkpointing,
            checkpointed_blocks,
        )
        times = self._step_times.get(key)
        if times is None:
            times = self._kernel_times(key)
            if self._warm:
                self._step_times[key] = times
        if accumulation_steps <= times.micro_steps:
            return times.total_s
        return times.total_s + (accumulation_steps - times.micro_steps) * times.middle_s

    def _timed_micro_steps(self, accumulation_steps: int, checkpointed_blocks: int | None) -> int:
        """How many micro-steps the speed pass of a step of `accumulation_steps` traces: 3 (a
        first, a middle and a last), or as many as its trial traces where the layer replay
        traces the trial's step at its length (a DDP rank, whose last micro-step
        synchronises: up to `_TRACED_ACCUMULATION`), so that one trace serves both
        (`_timed_along`)."""
        replay = self._replay_of(checkpointed_blocks)
        if replay is not None and not replay.writes_out_micro_steps:
            return min(accumulation_steps, _TRACED_ACCUMULATION)
        return min(accumulation_steps, _TIMED_ACCUMULATION)

    def _kernel_times(self, key: _TrialKey) -> _StepTimes:
        """The step's roofline time and its middle micro-step's: from the shallow model's
        speed pass by the layer replay when its trials are replayed (partial checkpointing's
        from its own traced model, `_replay_of`), else from the whole model's."""
        assert self.gpu is not None
        tf32 = bool(self.spec.training.tf32)
        replay = self._replay_of(key.checkpointed_blocks)
        partial = replay is not None and replay is self._partial
        if not (self._partial_speed_replay if partial else self._speed_replay):
            replay = None
        times: _StepTimes | None = None
        if replay is not None:
            try:
                plan, shallow_blocks = replay.plan(key.checkpointed_blocks)
                shallow_key = replace(key, checkpointed_blocks=shallow_blocks)
                layered = self._layered.get((replay.traced_layers, shallow_key))
                if layered is None:
                    with replay.speed_pass(self.gpu, self.assumptions, tf32) as layered:
                        self._timed_step(replay.runner, shallow_key, layered)
                    if self._warm:
                        self._layered[(replay.traced_layers, shallow_key)] = layered
                total_s, middle_s = step_times_s(layered.deep_times_s(plan))
                times = _StepTimes(total_s, middle_s, key.accumulation_steps)
            except NotReplayable as reason:
                logger.info("estimate: timing the whole model: %s", reason)
                if partial:
                    self._partial_speed_replay = False
                else:
                    self._speed_replay = False
        if times is None:
            whole = KernelTimes(self.gpu, self.assumptions, tf32)
            self._timed_step(self._runner, key, whole)
            middle_s = whole.ends_s[1] - whole.ends_s[0] if key.accumulation_steps >= 3 else 0.0
            times = _StepTimes(whole.time_s, middle_s, key.accumulation_steps)
        if key.accumulation_steps < 3:
            return times
        # Before the first forward a step makes all of its micro-batches and sums their item
        # counts (`TrainingStep.run`, `accumulate_gradients`), so a middle micro-step is its
        # batch's making and counting, and the kernels between two ends. Its count is added to
        # the sum of the counts before it, a count like it (a tensor's add to a tensor where a
        # count is one), as in the step's sum past its first batch.
        runner = self._any_runner
        making = KernelTimes(self.gpu, self.assumptions, tf32)
        with self._mode, making:
            batch = runner.workload.make_batch(key.micro_batch, runner.device.torch_device)
            count = runner.workload.num_items(batch)
            _ = count + count
        return _StepTimes(times.total_s, making.time_s + times.middle_s, times.micro_steps)

    def _timed_step(self, runner: InProcessRunner, key: _TrialKey, times: KernelTimes) -> None:
        """Runs `key`'s step on `runner` under `times`."""
        step = runner.step
        step.checkpointing = key.checkpointing
        step.checkpoint_blocks(key.checkpointed_blocks)
        ends = SpeedPass(times)
        with self._mode, _sequences_not_packed(), ends, times:
            with self._checked():
                step.run(key.micro_batch, key.accumulation_steps)
        if ends.micro_steps != key.accumulation_steps:
            raise RuntimeError(
                f"estimate: a step of {key.accumulation_steps} micro-steps ran "
                f"{ends.micro_steps} backward passes; its middle micro-step is unknown"
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
        """The estimated throughput of one configuration, with its traced peak; None when it
        does not fit. `target_seconds` is unused: nothing is timed."""
        del target_seconds
        blocks = checkpointed_blocks
        with self._timed_along(micro_batch, accumulation_steps, checkpointing, blocks):
            check = self.trial(
                micro_batch,
                accumulation_steps,
                checkpointing=checkpointing,
                checkpointed_blocks=checkpointed_blocks,
            )
        if not check.fits:
            return None
        return self.roofline_measurement(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            peak_bytes=check.peak_bytes,
            checkpointed_blocks=checkpointed_blocks,
        )

    @contextmanager
    def _timed_along(
        self,
        micro_batch: int,
        accumulation_steps: int,
        checkpointing: bool,
        checkpointed_blocks: int | None,
    ) -> Iterator[None]:
        """A measurement's trial, tracing its step's speed pass along where it can: on one
        rank the trial of a step of 3 micro-steps or more traces the shallow step of 3 its
        speed pass traces (`autotune.engine.replay.microstep_replay`), fewer the same few; a
        DDP rank traces up to `_TRACED_ACCUMULATION` for both (`_timed_micro_steps`).
        So one trace serves both (`LayerReplay.timed_along`). Only once warm, where a speed
        pass is kept, and when neither was traced before (the trial's journal may be known:
        the pass then traces its own)."""
        key = _trial_key(micro_batch, accumulation_steps, checkpointing, checkpointed_blocks)
        timed_steps = self._timed_micro_steps(accumulation_steps, key.checkpointed_blocks)
        timed = replace(key, accumulation_steps=timed_steps)
        traced = replace(key, accumulation_steps=min(accumulation_steps, _TRACED_ACCUMULATION))
        if (
            self.gpu is None
            or not self._warm
            or traced in self._outcomes
            or timed in self._step_times
        ):
            yield
            return
        replay = self._replay_of(key.checkpointed_blocks)
        partial = replay is not None and replay is self._partial
        if replay is None or not (self._partial_speed_replay if partial else self._speed_replay):
            yield
            return
        try:
            _, shallow_blocks = replay.plan(key.checkpointed_blocks)
        except NotReplayable:
            yield
            return
        shallow_key = replace(timed, checkpointed_blocks=shallow_blocks)
        if (replay.traced_layers, shallow_key) in self._layered:
            yield
            return
        shallow = (micro_batch, shallow_key.accumulation_steps, checkpointing, shallow_blocks)
        tf32 = bool(self.spec.training.tf32)
        with replay.timed_along(self.gpu, self.assumptions, tf32, shallow) as along:
            yield
        still = self._partial if partial else self._replay
        if along.times is not None and still is replay and self._warm:
            self._layered[(replay.traced_layers, shallow_key)] = along.times

    def roofline_measurement(
        self,
        micro_batch: int,
        accumulation_steps: int,
        *,
        checkpointing: bool,
        peak_bytes: int,
        checkpointed_blocks: int | None = None,
    ) -> Measurement:
        """A configuration's throughput by the roofline of its step (`step_time_s`), plus with
        several ranks the communication no compute hides (`communication`), with the peak a
        trial of it reached (traced here, or run on the emulated GPU)."""
        compute_s = self.step_time_s(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            checkpointed_blocks=checkpointed_blocks,
        )
        communication = self.communication(compute_s, accumulation_steps)
        step_time_s = compute_s if communication is None else communication.step_time_s
        samples = micro_batch * accumulation_steps
        tokens = self.tokens_per_sample
        return Measurement(
            samples_per_s=samples / step_time_s,
            tokens_per_s=samples * tokens / step_time_s if tokens is not None else None,
            step_time_s=step_time_s,
            step_time_spread=0.0,
            timed_steps=0,
            peak_bytes=peak_bytes,
            compute_time_s=None if communication is None else communication.compute_s,
            communication_time_s=None if communication is None else communication.communication_s,
            exposed_communication_s=None if communication is None else communication.exposed_s,
        )


__all__ = ["EstimateRunner", "check_traceable"]
