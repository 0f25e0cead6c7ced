"""The Python API: `autotune.probe`, `autotune.tune` and `autotune.estimate` from a script
(docs/design.md#the-python-api).

Each takes a spec (a `Spec`, a dict, or a file: a spec or a config `autotune.core.configs`
reads) or live objects: an `nn.Module`, one example batch (a tensor, a dict of tensors, or a
tuple or list of them as a Lightning dataloader yields, batch-first; tiled along the batch
dimension to any micro-batch), a loss (default: the model
output's `.loss`, as transformers models return) and the optimizer settings. It returns the
result the CLI prints (`ProbeResult`, `TuneResult` with `.exports`).

A spec's model is rebuilt here from its source. A live module cannot be rebuilt elsewhere: its
trials run in this process on a copy (the module you pass is left as it was), with the copy's
weights and optimizer state restored after every trial, and the result's device assumptions
say so. This is an entry point: it reads the allocator settings from the environment.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotune.core.configs import load_training_file
from autotune.core.errors import AutotuneError, SpecError
from autotune.core.gpus.cuda_reserve import GpuBudget
from autotune.core.memory.allocator_config import config_from_environ
from autotune.core.schemas import (
    DeviceInfo,
    ProbeResult,
    Recommendation,
    Sharding,
    Spec,
    StepOutcome,
    TrainingSpec,
    TuneResult,
)
from autotune.core.specfile import parse_spec
from autotune.engine.devices.cuda_runtime import CudaRuntime
from autotune.engine.devices.device import Device, EmulatedDevice, open_device
from autotune.engine.runner import ForwardingRunner, InProcessRunner, TrialRunner
from autotune.engine.training.workload import Batch, Workload, count_label_tokens

SpecLike = Spec | Mapping[str, Any] | str | Path
Loss = Callable[[nn.Module, Batch], torch.Tensor]
LIVE_ASSUMPTION = (
    "live module: trials ran in this process on a copy of the module, its weights and "
    "optimizer state restored after every trial (no child process: a crash ends the script)"
)


def probe(
    spec: SpecLike | None = None,
    *,
    model: nn.Module | None = None,
    batch: Batch | None = None,
    loss: Loss | None = None,
    device: str | None = None,
    memory: int | None = None,
    gpu: str | GpuBudget | None = None,
    **training: Any,
) -> ProbeResult:
    """The exact largest micro-batch, without and with checkpointing.

    Args:
        spec: a `Spec`, its dict, or a file path; or None with `model` and `batch`.
        model, batch, loss: live objects (see the module docstring).
        device: "cuda", "cuda:N", or "cpu" (the emulated GPU: needs `memory` or `gpu`);
            None: "cpu" when `memory` or `gpu` is given, else "cuda".
        memory: the emulated GPU's capacity in bytes (or a cap on a CUDA device).
        gpu: a catalogue GPU to emulate ("H100 80GB"), or a `GpuBudget`: a device as one
            process sees it (its allocator's capacity and the BLAS workspaces resident in it,
            e.g. a MIG slice's).
        **training: `TrainingSpec` fields for live objects (precision, optimizer, lora, ...).

    Raises:
        SpecError: an invalid spec or arguments, naming the field.
    """
    from autotune.engine.probe import probe_session

    runner = _runner(spec, model, batch, loss, device, memory, gpu, training)
    return probe_session(runner)


def tune(
    spec: SpecLike | None = None,
    *,
    model: nn.Module | None = None,
    batch: Batch | None = None,
    loss: Loss | None = None,
    device: str | None = None,
    memory: int | None = None,
    gpu: str | GpuBudget | None = None,
    storage_url: str = "sqlite://",
    trials: int | None = None,
    seconds_per_trial: float = 1.0,
    **training: Any,
) -> TuneResult:
    """The micro-batch x accumulation x checkpointing that hits the target global batch at the
    best samples/s, with `.exports`; arguments as `probe`, plus the Optuna storage (default:
    in memory), the trial budget and each measurement's duration. Live objects need
    `target_global_batch=`."""
    from autotune.engine.emulation.gpu_speed import timed_on_its_gpu
    from autotune.engine.tuner import tune_session

    if spec is not None and model is None:
        resolved = _spec(spec)

        def open_layout(layout: Spec) -> TrialRunner:
            # On an emulated named GPU, samples/s are that GPU's (roofline), as the tune
            # command's: this CPU's times would rank the configurations as this CPU runs them.
            return timed_on_its_gpu(
                _runner(layout, None, batch, loss, device, memory, gpu, training)
            )

        if resolved.training.sharding is Sharding.AUTO:
            return _tune_layouts(resolved, open_layout, storage_url, trials, seconds_per_trial)
        runner = open_layout(resolved)
    else:
        runner = _runner(spec, model, batch, loss, device, memory, gpu, training)
    return tune_session(
        runner, storage_url=storage_url, n_trials=trials, target_seconds=seconds_per_trial
    )


def estimate(
    spec: SpecLike,
    *,
    gpu: str,
    storage_url: str = "sqlite://",
    trials: int | None = None,
    processes: int = 1,
) -> TuneResult:
    """`tune` for a named GPU without running a step: traced on fake tensors, any model size,
    speed by roofline. Needs a spec (a model that can be rebuilt on fake tensors). With
    `sharding: auto`, `processes` layouts are tuned at a time, each in a forked process
    (`tune --estimate --processes`).

    Raises:
        SpecError: a live module, or an invalid spec.
        ValueError: `processes` < 1.
    """
    if isinstance(spec, nn.Module):
        raise SpecError("estimate: needs a spec (a model it can rebuild on fake tensors)")
    from autotune.core.gpus.catalogue import find_gpu
    from autotune.core.gpus.cuda_reserve import budget_for
    from autotune.engine.estimate import EstimateRunner
    from autotune.engine.tuner import tune_session

    resolved = _spec(spec)
    allocator_config = config_from_environ(os.environ)
    named = find_gpu(gpu)

    def open_layout(layout: Spec) -> TrialRunner:
        budget = budget_for(named, layout.training.world_size)
        return EstimateRunner(layout, gpu=budget, allocator_config=allocator_config)

    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if resolved.training.sharding is Sharding.AUTO:
        return _tune_layouts(resolved, open_layout, storage_url, trials, processes=processes)
    return tune_session(open_layout(resolved), storage_url=storage_url, n_trials=trials)


def _tune_layouts(
    spec: Spec,
    open_layout: Callable[[Spec], TrialRunner],
    storage_url: str,
    trials: int | None,
    seconds_per_trial: float = 1.0,
    processes: int = 1,
) -> TuneResult:
    """`sharding: auto`: every layout valid for the topology tuned on a runner of its own, the
    fastest recommended, every layout's outcome in `.layouts` (as the tune command); an
    estimate's `processes` at a time."""
    from autotune.engine.layout_tuning import tune_layouts
    from autotune.engine.probe import FitTracer

    def layout_runner(layout: Spec) -> tuple[TrialRunner, FitTracer | None]:
        return open_layout(layout), None

    return tune_layouts(
        spec,
        layout_runner,
        storage_url=storage_url,
        n_trials=trials,
        target_seconds=seconds_per_trial,
        processes=processes,
    )


def stored_recommendation(
    spec: Spec,
    *,
    server: str,
    token: str | None = None,
    memory: int | None = None,
    gpu: str | None = None,
    wait_s: float = 0,
    device: str | None = None,
    cuda: CudaRuntime | None = None,
) -> Recommendation:
    """What a running autotune server has stored for `spec` (waiting up to `wait_s` for a
    worker), so a fleet's stored results answer at once: on the emulated GPU of `memory` bytes
    or the named `gpu`, or, with neither, on this machine's CUDA `device` ("cuda" or "cuda:N"):
    what the fleet's workers on the same card, under this process's allocator settings,
    measured. The request stays queued on the server when nothing is stored. `cuda`: the CUDA
    runtime (torch.cuda when None; the simulated backend in tests).

    Raises:
        SpecError: both `memory` and `gpu`, or either with a CUDA `device`.
        DeviceError: no memory or gpu given, and CUDA is unavailable.
        AutotuneError: the server has no recommendation yet (the run's URL says where it
            stands), or cannot be reached.
    """
    from autotune.remote.client import ServerClient
    from autotune.remote.protocol import CudaTarget, EmulatedTarget

    target: EmulatedTarget | CudaTarget
    if memory is not None or gpu is not None:
        if memory is not None and gpu is not None:
            raise SpecError("server: give memory= or gpu=, not both")
        if device not in (None, "cpu"):
            raise SpecError(f"server: memory= and gpu= name an emulated GPU, not {device!r}")
        target = EmulatedTarget(memory_bytes=memory, gpu=gpu)
    else:
        # The card as a worker on it reports itself: its name, its total memory and the
        # allocator settings it runs under (a run's identity), read from the device itself.
        card = open_device(
            device or "cuda", cuda=cuda, allocator_config=config_from_environ(os.environ)
        ).info
        target = CudaTarget(
            name=card.name,
            memory_bytes=card.total_memory_bytes,
            allocator_conf=card.allocator_conf,
        )
    with ServerClient(server, token=token) as client:
        submitted = client.submit_run(spec, target, wait_s=wait_s)
    run = submitted.run
    if run is None or run.recommendation is None:
        status = run.status.value if run is not None else submitted.status.value
        reason = run.infeasible.reason if run is not None and run.infeasible else None
        raise AutotuneError(
            f"server: no stored recommendation for this module on {target.label} "
            f"(run {submitted.id} is {status}{': ' + reason if reason else ''}; {submitted.url})"
        )
    return run.recommendation


def recommendation_of(result: TuneResult, caller: str) -> Recommendation:
    """The result's recommendation, for an integration that applies it.

    Raises:
        AutotuneError: none, with the reason the tuner gave, prefixed by `caller`.
    """
    if result.recommendation is None:
        reason = result.infeasible.reason if result.infeasible else "no configuration fits"
        raise AutotuneError(f"{caller}: {reason}")
    return result.recommendation


def _spec(spec: SpecLike) -> Spec:
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, str | Path):
        return load_training_file(spec).spec
    return parse_spec(dict(spec))


def _runner(
    spec: SpecLike | None,
    model: nn.Module | None,
    batch: Batch | None,
    loss: Loss | None,
    device: str | None,
    memory: int | None,
    gpu: str | GpuBudget | None,
    training: dict[str, Any],
) -> TrialRunner:
    if (spec is None) == (model is None):
        raise SpecError("give a spec, or a model and an example batch (one of the two)")
    if spec is not None and (batch is not None or loss is not None or training):
        raise SpecError("batch, loss and training fields go with a live model, not a spec")
    resolved: Spec
    workload: Workload | None = None
    if model is not None:
        if batch is None:
            raise SpecError("batch: a live model needs one example batch")
        resolved, workload = live_workload(model, batch, loss, training)
        if resolved.training.sharding is Sharding.AUTO:
            raise SpecError(
                "training.sharding: auto tunes each layout on a model of its own, built from a "
                "spec; a live module is one object: give its spec, or set one layout"
            )
    else:
        assert spec is not None
        resolved = _spec(spec)
    name = device or ("cpu" if memory is not None or gpu is not None else "cuda")
    opened: Device
    if isinstance(gpu, GpuBudget):
        if name != "cpu" or memory is not None:
            raise SpecError("gpu: a GpuBudget is emulated on the cpu device, without memory=")
        opened = EmulatedDevice(gpu=gpu, allocator_config=config_from_environ(os.environ))
    else:
        opened = open_device(
            name,
            memory,
            gpu=gpu,
            world_size=resolved.training.world_size,
            allocator_config=config_from_environ(os.environ),
        )
    if workload is None:
        return InProcessRunner(resolved, opened)
    return LiveRunner(InProcessRunner(resolved, opened, workload=workload))


class LiveRunner(ForwardingRunner):
    """Trials on a live module's copy in this process: after each one the weights and the
    optimizer state go back to the warm-up's, so every trial starts from the same state."""

    def __init__(self, runner: InProcessRunner) -> None:
        super().__init__(runner)
        self._inner = runner

    @property
    def device_info(self) -> DeviceInfo:
        info = self._inner.device_info
        return info.model_copy(update={"assumptions": [*info.assumptions, LIVE_ASSUMPTION]})

    def trial(
        self,
        micro_batch: int,
        accumulation_steps: int = 1,
        *,
        checkpointing: bool,
        checkpointed_blocks: int | None = None,
    ) -> StepOutcome:
        outcome = self._inner.trial(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            checkpointed_blocks=checkpointed_blocks,
        )
        self._inner.restore()
        return outcome

    def measure(self, *args: Any, **kwargs: Any) -> Any:
        measured = self._inner.measure(*args, **kwargs)
        self._inner.restore()
        return measured


def live_spec(model: nn.Module, batch: Batch, training: dict[str, Any]) -> Spec:
    """The spec that describes a live module (its class as the label), its example batch's
    shape and the training fields: what a run of it is stored and looked up under.

    Raises:
        SpecError: a batch that is neither a tensor nor a dict, tuple or list of batch-first
            tensors; invalid training fields.
    """
    _rows(batch)
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    tokens = int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
    shape: dict[str, Any] = {"seq_len": tokens}
    first = _tensors(batch)[0]
    if tokens is None and not isinstance(batch, Mapping) and first.dim() > 1:
        shape = {"input_shape": tuple(first.shape[1:])}
    kind = type(model)
    label = f"{kind.__module__}:{kind.__name__}".replace("<", "_").replace(">", "_")
    from pydantic import ValidationError

    from autotune.core.specfile import describe_validation_error

    try:
        spec = Spec(model={"factory": label}, training=TrainingSpec(**shape, **training))
    except ValidationError as error:
        raise SpecError(describe_validation_error(error)) from None
    return spec


def live_workload(
    model: nn.Module, batch: Batch, loss: Loss | None, training: dict[str, Any]
) -> tuple[Spec, Workload]:
    """A spec describing a live module (its class as the label) and the workload that trains
    a copy of it on tiles of `batch`.

    Raises:
        SpecError: a batch that is neither a tensor nor a dict of batch-first tensors.
    """
    spec = live_spec(model, batch, training)
    rows = _rows(batch)
    copied = copy.deepcopy(model)
    labels = isinstance(batch, Mapping) and "labels" in batch

    def make_batch(micro_batch: int, device: torch.device) -> Batch:
        index = torch.arange(micro_batch, device=device) % rows
        if isinstance(batch, torch.Tensor):
            return batch.to(device)[index]
        if isinstance(batch, Mapping):
            return {key: value.to(device)[index] for key, value in batch.items()}
        return type(batch)(value.to(device)[index] for value in batch)

    def loss_sum(module: nn.Module, tiled: Batch) -> torch.Tensor:
        mean = loss(module, tiled) if loss is not None else _output_loss(module, tiled)
        return mean * num_items(tiled)

    def num_items(tiled: Batch) -> int | torch.Tensor:
        if labels and loss is None:
            return count_label_tokens(tiled)  # what a transformers model's loss averages over
        return int(_tensors(tiled)[0].shape[0])

    switch = None
    checkpointable = checkpointable_module(copied)
    if checkpointable is not None:
        from autotune.engine.training.workload import hf_checkpointing

        switch = hf_checkpointing(checkpointable)
    return spec, Workload(
        model=copied,
        make_batch=make_batch,
        loss_sum=loss_sum,
        num_items=num_items,
        set_checkpointing=switch,
        tokens_per_sample=spec.training.seq_len,
        partial_checkpointing=switch if switch is not None and switch.num_blocks else None,
    )


def checkpointable_module(model: nn.Module) -> nn.Module | None:
    """The module whose checkpointing autotune can switch: `model` itself or the first of its
    submodules that supports transformers' gradient checkpointing (a LightningModule holding a
    transformers model), or None."""
    for module in model.modules():
        if getattr(module, "supports_gradient_checkpointing", False):
            return module
    return None


def _tensors(batch: Batch) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return list(batch.values())
    if isinstance(batch, tuple | list):
        return list(batch)
    return []


def _rows(batch: Batch) -> int:
    tensors = _tensors(batch)
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
        raise SpecError(
            "batch: a tensor, or a dict, tuple or list of tensors, batch dimension first"
        )
    rows = {int(t.shape[0]) for t in tensors}
    if len(rows) != 1 or 0 in rows:
        raise SpecError(f"batch: every tensor needs the same batch size, got {sorted(rows)}")
    return rows.pop()


def _output_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    output = model(**batch) if isinstance(batch, Mapping) else model(batch)
    value = getattr(output, "loss", None)
    if not isinstance(value, torch.Tensor):
        raise SpecError("loss: the model's output has no .loss; pass loss=fn(model, batch)")
    return value
