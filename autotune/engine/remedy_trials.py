"""What would make a job fit, verified: every change of `autotune.core.remedies` applied to the
spec and traced on fake tensors on the same GPU (`autotune.engine.estimate`), at micro-batch 1,
plain first and then checkpointed. A change is a remedy only when its traced steady-state step
fits; its speed is the roofline of that step on the named GPU, for the whole job
(docs/design.md#what-would-make-it-fit).

The GPU is the one the spec did not fit on: a catalogue GPU (`--gpu`, `--estimate`, or a card
the catalogue knows), whose capacity follows the world size as it does everywhere (NCCL's
buffers), or a bare capacity (`--memory`), which gives no speed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from autotune.core.errors import ModelBuildError
from autotune.core.gpus.catalogue import UnknownGpu, find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.memory.allocator_config import AllocatorConfig
from autotune.core.remedies import (
    MAX_WORLD_SIZE,
    NOT_MODELLED_OFFLOAD,
    Change,
    gpu_counts,
    is_doubling_point,
    paired_changes,
    ranked,
    sharded_change,
    shorter_sequence_change,
    single_gpu_changes,
)
from autotune.core.schemas import (
    DeviceInfo,
    FitAdvice,
    ProbeResult,
    Remedy,
    SequenceProbeResult,
    Spec,
)
from autotune.core.search.micro_batch import fewest_fitting
from autotune.core.search.sequence import DEFAULT_STEP_TOKENS
from autotune.engine.estimate import EstimateRunner
from autotune.engine.full_collections import with_few_full_collections
from autotune.engine.probe import device_allocator_config
from autotune.engine.runner import TrialRunner
from autotune.engine.sequence_probe import (
    CheckpointingUnsupported,
    probe_max_seq_len,
    sequence_trial,
)

logger = logging.getLogger(__name__)

# Called when a change is about to be traced, with its description.
ChangeCallback = Callable[[str], None]


@dataclass(frozen=True)
class SameGpu:
    """The GPU a spec fits nowhere on, for the changed specs' traced trials: a catalogue name
    (memory and speed), else a bare capacity (memory only)."""

    gpu_name: str | None
    capacity_bytes: int
    allocator_config: AllocatorConfig | None = None
    # As `EstimateRunner` takes them: a worker's factory prefixes and its stop check.
    allowed_factory_prefixes: list[str] | None = field(default=None, compare=False)
    interrupt: Callable[[], None] | None = field(default=None, compare=False)

    @classmethod
    def of(
        cls,
        info: DeviceInfo,
        allocator_config: AllocatorConfig | None = None,
        *,
        allowed_factory_prefixes: list[str] | None = None,
        interrupt: Callable[[], None] | None = None,
    ) -> SameGpu:
        """The device a probe ran on: its named GPU when it has one (an emulated or estimated
        catalogue GPU, or a real card the catalogue knows), else its capacity."""
        gpu_name = None
        for name in (info.gpu, info.name):
            try:
                gpu_name = find_gpu(name).name if name is not None else None
            except UnknownGpu:
                continue
            if gpu_name is not None:
                break
        return cls(
            gpu_name, info.capacity_bytes, allocator_config, allowed_factory_prefixes, interrupt
        )

    def runner(self, spec: Spec) -> EstimateRunner:
        gpu = self.gpu_name
        return EstimateRunner(
            spec,
            gpu=None if gpu is None else budget_for(find_gpu(gpu), spec.training.world_size),
            capacity_bytes=self.capacity_bytes if gpu is None else None,
            allocator_config=self.allocator_config,
            allowed_factory_prefixes=self.allowed_factory_prefixes,
            interrupt=self.interrupt,
        )


def _changed(spec: Spec, change: Change) -> Spec | None:
    try:
        return spec.with_training(change.fields)
    except ValidationError as error:
        logger.info("%s: not a valid spec (%s)", change.label, error.errors()[0]["msg"])
        return None


def verify(spec: Spec, change: Change, gpu: SameGpu) -> Remedy | None:
    """The change as a remedy when the changed spec's traced step fits at micro-batch 1 (plain,
    else checkpointed); None when it does not fit, or cannot be built (a model peft cannot
    adapt, say). Both modes run on one runner, as a probe's warm-ups do: the model is built
    once."""
    changed = _changed(spec, change)
    if changed is None:
        return None
    built: list[EstimateRunner] = []

    def runner(_: Spec) -> EstimateRunner:
        # `sequence_trial` asks for a runner of `changed` in each mode: the same one.
        if not built:
            built.append(gpu.runner(changed))
        return built[0]

    try:
        for checkpointing in (False, True):
            outcome, runner_used = sequence_trial(
                changed, runner, micro_batch=1, checkpointing=checkpointing
            )
            if outcome.fits:
                return _remedy(
                    changed, change, runner_used, checkpointing, outcome.peak_bytes, gpu
                )
            if not runner_used.supports_checkpointing:
                return None
    except ModelBuildError as error:
        # Any other error (a stop, a limit) ends the search for remedies: it is not the change's.
        logger.info("%s: cannot be built (%s)", change.label, error)
    return None


def _remedy(
    spec: Spec,
    change: Change,
    runner: TrialRunner,
    checkpointing: bool,
    peak_bytes: int,
    gpu: SameGpu,
) -> Remedy:
    assert isinstance(runner, EstimateRunner)
    world_size = spec.training.world_size
    per_gpu = None
    if gpu.gpu_name is not None:
        per_gpu = runner.roofline_measurement(
            1, 1, checkpointing=checkpointing, peak_bytes=peak_bytes
        )
    return Remedy(
        change=change.label,
        spec_diff=change.fields,
        checkpointing=checkpointing,
        micro_batch=1,
        seq_len=spec.training.seq_len,
        world_size=world_size,
        peak_bytes=peak_bytes,
        capacity_bytes=runner.device_info.capacity_bytes,
        samples_per_s=None if per_gpu is None else per_gpu.samples_per_s * world_size,
        samples_per_s_per_gpu=None if per_gpu is None else per_gpu.samples_per_s,
        tokens_per_s=(
            None
            if per_gpu is None or per_gpu.tokens_per_s is None
            else per_gpu.tokens_per_s * world_size
        ),
    )


def fewest_gpus(spec: Spec, gpu: SameGpu) -> Remedy | None:
    """ZeRO-3 on the fewest GPUs that fit (`autotune.core.remedies.gpu_counts`): doubling to
    the first count that fits, then bisecting between it and the last that did not (fitting is
    monotone in the count: each rank holds 1/N of the state)."""
    gpus_per_box = find_gpu(gpu.gpu_name).largest_box.gpus if gpu.gpu_name else MAX_WORLD_SIZE
    counts = gpu_counts(spec, gpus_per_box)
    found: dict[int, Remedy] = {}

    def fits(index: int) -> bool:
        remedy = verify(spec, sharded_change(counts[index], gpus_per_box), gpu)
        if remedy is not None:
            found[index] = remedy
        return remedy is not None

    failing = -1
    for index, count in enumerate(counts):
        if not is_doubling_point(count, gpus_per_box):
            continue
        if fits(index):
            return found[fewest_fitting(fits, failing=failing, fitting=index)]
        failing = index
    return None


def shorter_sequence(spec: Spec, gpu: SameGpu, step_tokens: int) -> Remedy | None:
    """The longest sequence (a multiple of `step_tokens`, shorter than the spec's) that fits at
    micro-batch 1 in either mode, as a remedy. Searched checkpointed only: checkpointing only
    removes saved activations, so no plain step fits a longer one (the remedy's own trial
    still tries plain first)."""
    seq_len = spec.training.seq_len
    if seq_len is None or seq_len <= step_tokens:
        return None

    def search(checkpointing: bool) -> SequenceProbeResult:
        return probe_max_seq_len(
            spec,
            gpu.runner,
            micro_batch=1,
            step_tokens=step_tokens,
            cap_tokens=seq_len - 1,
            modes=(checkpointing,),
        )

    try:
        found = search(True)
    except CheckpointingUnsupported:
        found = search(False)
    longest = max((mode.max_seq_len for mode in found.modes), default=0)
    if longest == 0:
        return None
    return verify(spec, shorter_sequence_change(longest), gpu)


@with_few_full_collections
def find_fit_advice(
    spec: Spec,
    gpu: SameGpu,
    *,
    step_tokens: int = DEFAULT_STEP_TOKENS,
    on_change: ChangeCallback | None = None,
) -> FitAdvice:
    """Every change of `autotune.core.remedies` that makes `spec` fit on `gpu`, verified by
    traced trials, fastest first; pairs of single-GPU changes only when no single one fits."""

    def announce(label: str) -> None:
        logger.info("what would make it fit: %s", label)
        if on_change is not None:
            on_change(label)

    remedies: list[Remedy] = []
    too_large: list[str] = []
    announce("more GPUs with ZeRO-3")
    sharded = fewest_gpus(spec, gpu)
    if sharded is not None:
        remedies.append(sharded)
    else:
        too_large.append(f"ZeRO-3 on up to {MAX_WORLD_SIZE} GPUs")

    def try_each(changes: list[Change]) -> None:
        for change in changes:
            announce(change.label)
            remedy = verify(spec, change, gpu)
            if remedy is None:
                too_large.append(change.label)
            else:
                remedies.append(remedy)

    singles = single_gpu_changes(spec)
    try_each(singles)
    if not any(r.world_size == spec.training.world_size for r in remedies):
        try_each(paired_changes(singles))
    if spec.training.seq_len is not None:
        announce("a shorter sequence")
        shorter = shorter_sequence(spec, gpu, step_tokens)
        if shorter is None:
            too_large.append(f"any sequence of {step_tokens} tokens or more")
        else:
            remedies.append(shorter)
    return FitAdvice(
        remedies=ranked(remedies), still_too_large=too_large, not_modelled=[NOT_MODELLED_OFFLOAD]
    )


def fits_nowhere(result: ProbeResult) -> bool:
    """Micro-batch 1 fits in no checkpointing mode."""
    return all(mode.max_micro_batch == 0 for mode in result.modes)


def with_fit_advice(
    spec: Spec,
    result: ProbeResult,
    *,
    on_change: ChangeCallback | None = None,
    allowed_factory_prefixes: list[str] | None = None,
    interrupt: Callable[[], None] | None = None,
) -> ProbeResult:
    """`result`, with what would make `spec` fit on its device when it fits nowhere (the
    traces run with `allowed_factory_prefixes` and `interrupt` as `EstimateRunner`'s)."""
    if not fits_nowhere(result):
        return result
    gpu = SameGpu.of(
        result.device,
        device_allocator_config(result.device),
        allowed_factory_prefixes=allowed_factory_prefixes,
        interrupt=interrupt,
    )
    advice = find_fit_advice(spec, gpu, on_change=on_change)
    return result.model_copy(update={"fit_advice": advice})


__all__ = [
    "SameGpu",
    "fewest_gpus",
    "find_fit_advice",
    "fits_nowhere",
    "shorter_sequence",
    "verify",
    "with_fit_advice",
]
