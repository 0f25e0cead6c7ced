"""LoRA adapters on a frozen base model, built with the `peft` library (docs/design.md#lora).

`apply_lora` does what a fine-tuning script does with
`peft.get_peft_model(model, LoraConfig(...))`: the base model's parameters stop requiring
gradients, so they get no gradients and no optimizer state, and small `lora_A`/`lora_B`
matrices are added beside each targeted linear layer (with `modules_to_save`, a trainable copy
of those modules). The training step then runs unchanged on the wrapped model.

On a bf16 base peft keeps the adapters in fp32 (`autocast_adapter_dtype`), so
`adapter_parameter_ids` tells the weights' cast which parameters to leave alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autotune.core.errors import SpecError
from autotune.core.plugins import import_extra
from autotune.core.schemas import LoraSpec

# Adapter parameters are named by peft's layers: `...q_proj.lora_A.default.weight`.
_ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.")


def apply_lora(model: nn.Module, lora: LoraSpec) -> nn.Module:
    """`model` wrapped by peft with LoRA adapters as `lora` says.

    Raises:
        ModelBuildError: peft is not installed (the `lora` extra).
        SpecError: a target module or module to save is not in the model.
    """
    peft = import_extra("peft", needed_for="training.lora", extra="lora")
    target_modules: str | list[str] = lora.target_modules
    exclude: list[str] | None = None
    if lora.target_modules == "all-linear" and not _is_transformers_model(model):
        # peft leaves out the output head only on transformers models; our presets name it so.
        head = getattr(model, "lm_head", None)
        exclude = ["lm_head"] if isinstance(head, nn.Linear) else None
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=target_modules,
        exclude_modules=exclude,
        modules_to_save=list(lora.modules_to_save) or None,
    )
    missing = [name for name in lora.modules_to_save if not _has_module(model, name)]
    if missing:
        raise SpecError(
            f"training.lora.modules_to_save: no module named {missing[0]!r} in the model"
        )
    try:
        with _moves_in_place_skipped():
            wrapped: nn.Module = peft.get_peft_model(model, config)
    except ValueError as exc:
        # peft: "Target modules {...} not found in the base model. Please check ..."
        raise SpecError(f"training.lora.target_modules: {str(exc).splitlines()[0]}") from exc
    return wrapped


def adapter_parameter_ids(model: nn.Module) -> set[int]:
    """The ids of the LoRA matrices' parameters."""
    return {
        id(param)
        for name, param in model.named_parameters()
        if any(marker in f".{name}" for marker in _ADAPTER_MARKERS)
    }


def trainable_parameter_count(model: nn.Module) -> int:
    """Parameters that get gradients and optimizer state (shared ones once)."""
    seen: dict[int, int] = {}
    for param in model.parameters():
        if param.requires_grad:
            seen[id(param)] = param.numel()
    return sum(seen.values())


def _is_transformers_model(model: nn.Module) -> bool:
    return any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__)


def _has_module(model: nn.Module, name: str) -> bool:
    return any(
        qualified == name or qualified.endswith(f".{name}")
        for qualified, _ in model.named_modules()
    )


@contextlib.contextmanager
def _moves_in_place_skipped() -> Iterator[None]:
    """peft moves each new adapter (and each replaced layer) to its base layer's device and dtype
    with `Module.to`, which on a model of fake tensors (the estimate) swaps parameters and fails
    even when nothing moves. Applied before the weights' cast, on the model's device, nothing
    does move: such a `to` returns the module as it is, any other runs as torch's."""
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if memory_format is None and all(
            (device is None or t.device == device)
            and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
            for t in tensors
        ):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]
