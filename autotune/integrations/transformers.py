"""Tuned `TrainingArguments` for a Hugging Face `Trainer` (docs/design.md#the-python-api).

    args = tuned_arguments(model, args, train_dataset, data_collator, memory=..., gpu=...)

The probe trains on a real batch: the longest samples of the dataset (the worst case a step
will meet), collated by the person's collator, tiled to every micro-batch. The global batch the
arguments ask for (per-device batch x accumulation x world size) is kept exactly; what changes
is the per-device batch, the accumulation and checkpointing, at the best measured samples/s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from autotune.core.configs.optimizer_names import optimizer_named
from autotune.core.errors import SpecError
from autotune.core.schemas import Precision, Recommendation, Spec

_CHECKPOINTING_FIELDS = ("gradient_checkpointing", "activation_checkpointing")


def longest_samples(dataset: Sequence[Any], count: int) -> list[Any]:
    """The `count` samples with the most `input_ids` (all when fewer), longest first.

    Raises:
        SpecError: an empty dataset.
    """
    if len(dataset) == 0:
        raise SpecError("train_dataset: empty; the probe needs one real batch")

    def length(index: int) -> int:
        sample = dataset[index]
        ids = sample.get("input_ids") if isinstance(sample, dict) else None
        return len(ids) if ids is not None else 0

    order = sorted(range(len(dataset)), key=length, reverse=True)
    return [dataset[index] for index in order[: max(1, count)]]


def tuned_arguments(
    model: nn.Module,
    args: Any,
    train_dataset: Sequence[Any],
    data_collator: Callable[[list[Any]], Any] | None = None,
    *,
    device: str | None = None,
    memory: int | None = None,
    gpu: str | None = None,
    trials: int | None = None,
    seconds_per_trial: float = 1.0,
    server: str | None = None,
    token: str | None = None,
    wait_s: float = 0,
) -> Any:
    """`args` (a `TrainingArguments`) with `per_device_train_batch_size`,
    `gradient_accumulation_steps` and checkpointing tuned for `model` on the device (as
    `autotune.tune`: "cuda", "cuda:N", or the emulated GPU of `memory` / `gpu`). With `server`
    (and its `token`), a running autotune server's stored recommendation for the model on the
    emulated GPU of `memory` / `gpu`, or with neither on this machine's CUDA `device`, answers
    instead, at once
    (`autotune.python_api.stored_recommendation`), looked up by the model's config (a spec the
    fleet's workers can rebuild and tune when nothing is stored yet).

    Raises:
        SpecError: an optimizer or a dataset autotune cannot probe with, naming it.
        AutotuneError: no configuration keeps the global batch (the reason says why).
    """
    from transformers import default_data_collator

    from autotune.python_api import live_spec, recommendation_of, stored_recommendation, tune

    batch = dict(
        (data_collator or default_data_collator)(
            longest_samples(train_dataset, args.per_device_train_batch_size)
        )
    )
    if server is not None:
        # The model's config, not its class: a spec any worker of the fleet can rebuild.
        described = live_spec(model, batch, training_fields(args))
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            raise SpecError("server: the model has no transformers config to name it by")
        spec = Spec(model={"hf_config": config.to_dict()}, training=described.training)
        rec = stored_recommendation(
            spec,
            server=server,
            token=token,
            memory=memory,
            gpu=gpu,
            wait_s=wait_s,
            device=device,
        )
        return arguments_of(args, rec)
    result = tune(
        model=model,
        batch=batch,
        device=device,
        memory=memory,
        gpu=gpu,
        trials=trials,
        seconds_per_trial=seconds_per_trial,
        **training_fields(args),
    )
    return arguments_of(args, recommendation_of(result, "tuned_arguments"))


def training_fields(args: Any) -> dict[str, Any]:
    """The spec's training fields that `TrainingArguments` say."""
    world_size = int(args.world_size)
    precision = Precision.BF16 if args.bf16 else Precision.FP16 if args.fp16 else Precision.FP32
    optim = getattr(args.optim, "value", args.optim)
    optimizer, _ = optimizer_named("optim", optim)
    return {
        "target_global_batch": args.per_device_train_batch_size
        * args.gradient_accumulation_steps
        * world_size,
        "world_size": world_size,
        "precision": precision,
        "optimizer": optimizer,
    }


def arguments_of(args: Any, rec: Recommendation) -> Any:
    """`args` with the recommendation's batch, accumulation and checkpointing."""
    changes: dict[str, Any] = {
        "per_device_train_batch_size": rec.micro_batch,
        "gradient_accumulation_steps": rec.accumulation_steps,
    }
    # transformers 5 has both names (the old one an alias): set each the version has.
    for name in _CHECKPOINTING_FIELDS:
        if hasattr(args, name):
            changes[name] = rec.checkpointing
    return dataclasses.replace(args, **changes)
