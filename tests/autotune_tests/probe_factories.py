"""Factories used by the probe tests: user models that misbehave on purpose.

Each follows the factory contract: `function(training: TrainingSpec) -> Workload`.
"""

from __future__ import annotations

import torch
from torch import nn

from autotune.core.schemas import TrainingSpec
from autotune.engine.training.workload import Workload


class _Raising(nn.Module):
    """A linear model whose forward raises `error` once the batch exceeds `limit` samples."""

    def __init__(self, limit: int, error: Exception) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.limit = limit
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise self.error
        out: torch.Tensor = self.linear(x)
        return out


def _workload(model: nn.Module) -> Workload:
    def make_batch(micro_batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(micro_batch, 16, device=device), torch.randint(
            0, 4, (micro_batch,), device=device
        )

    def loss_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, reduction="sum")

    def num_items(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return int(batch[1].shape[0])

    return Workload(model=model, make_batch=make_batch, loss_sum=loss_sum, num_items=num_items)


def real_oom_above_5(training: TrainingSpec) -> Workload:
    """Raises torch.OutOfMemoryError itself (as CUDA would) above 5 samples."""
    return _workload(_Raising(5, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate")))


def cpu_allocator_failure_above_4(training: TrainingSpec) -> Workload:
    """Raises the CPU allocator's plain RuntimeError above 4 samples."""
    message = (
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 419430400 bytes. Error code 12 (Cannot allocate memory)"
    )
    return _workload(_Raising(4, RuntimeError(message)))


def value_error_above_2(training: TrainingSpec) -> Workload:
    """A bug in user code (not an OOM) above 2 samples: must surface unchanged."""
    return _workload(_Raising(2, ValueError("shape mismatch in user model")))


def runtime_error_above_2(training: TrainingSpec) -> Workload:
    """A RuntimeError that is not an OOM: must surface unchanged."""
    return _workload(_Raising(2, RuntimeError("CUDA error: an illegal memory access")))
