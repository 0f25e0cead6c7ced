"""Factories for the worker tests: small, fast models, and models that crash or hang on purpose.

Each follows the factory contract, `function(training: TrainingSpec) -> Workload`; specs name
them as "tests.probes_tests.factories:NAME" (importable from the repository root, which is where
the tests start workers).
"""

from __future__ import annotations

import multiprocessing.util
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from autotune.core.schemas import ModelSpec, Spec, TrainingSpec
from autotune.engine.training.workload import Workload

HIDDEN = 4096
CLASSES = 10

Hook = Callable[[int, int], None]
"""Runs first in every forward, with (batch size, forwards so far in this process)."""


class _Wide(nn.Module):
    """One wide hidden layer: activations (16 KiB a sample per tensor) outweigh the weights, so
    an emulated capacity of a few MiB binds at a micro-batch of tens, and a step takes about a
    millisecond."""

    def __init__(self, features: int, on_forward: Hook | None = None) -> None:
        super().__init__()
        self.hidden = nn.Linear(features, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)
        self.on_forward = on_forward
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.on_forward is not None:
            self.on_forward(x.shape[0], self.calls)
        logits: torch.Tensor = self.out(torch.relu(self.hidden(x)))
        return logits


def _workload(training: TrainingSpec, on_forward: Hook | None = None) -> Workload:
    features = training.input_shape[0] if training.input_shape else 64
    model = _Wide(features, on_forward)

    def make_batch(micro_batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(micro_batch, features, device=device)
        return inputs, torch.randint(0, CLASSES, (micro_batch,), device=device)

    def loss_sum(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, labels = batch
        return nn.functional.cross_entropy(module(inputs), labels, reduction="sum")

    def num_items(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return int(batch[1].shape[0])

    return Workload(model=model, make_batch=make_batch, loss_sum=loss_sum, num_items=num_items)


def wide(training: TrainingSpec) -> Workload:
    """The healthy model; `training.input_shape` = (features,) sizes the first layer."""
    return _workload(training)


def _abort_above(limit: int) -> Hook:
    def hook(batch_size: int, calls: int) -> None:
        if batch_size > limit:
            os.abort()  # SIGABRT, as a failed assertion in native code would

    return hook


def _hang_above(limit: int) -> Hook:
    def hook(batch_size: int, calls: int) -> None:
        if batch_size > limit:
            # Tests wait for this line (the child's stderr is its worker's log) instead of
            # sleeping until the hang has surely begun.
            print(f"hang_above_{limit}: hanging at micro-batch {batch_size}", file=sys.stderr)
            sys.stderr.flush()
        while batch_size > limit:  # a deadlock, as far as anyone outside can tell
            time.sleep(60)

    return hook


def _start_sleep_then_hang() -> Hook:
    def hook(batch_size: int, calls: int) -> None:
        # A process of the trial's own (as a data loader's worker would be), then a hang.
        subprocess.Popen(["sleep", "300"])
        while True:
            time.sleep(60)

    return hook


def _raise_boom(batch_size: int, calls: int) -> None:
    raise ValueError("boom")


def _abort_on_call(call: int) -> Hook:
    def hook(batch_size: int, calls: int) -> None:
        if calls >= call:
            os.abort()

    return hook


def abort_above_4(training: TrainingSpec) -> Workload:
    """Aborts the process in any forward of more than 4 samples."""
    return _workload(training, _abort_above(4))


def hang_above_4(training: TrainingSpec) -> Workload:
    """Never returns from a forward of more than 4 samples."""
    return _workload(training, _hang_above(4))


def sleep_then_hang(training: TrainingSpec) -> Workload:
    """Starts `sleep 300` in its first forward, then never returns."""
    return _workload(training, _start_sleep_then_hang())


def raise_boom(training: TrainingSpec) -> Workload:
    """A bug in the user's model: every forward raises ValueError("boom")."""
    return _workload(training, _raise_boom)


def abort_in_measurement(training: TrainingSpec) -> Workload:
    """Aborts at the 5th forward within one process. A probe child runs at most 3 (warm-up, then
    a trial of up to 2 accumulated micro-batches); a measurement child runs at least 5 (warm-up,
    the tracked check, 3 timed steps), so only throughput measurements crash."""
    return _workload(training, _abort_on_call(5))


def abort_at_exit(training: TrainingSpec) -> Workload:
    """The healthy model, in a process that aborts on its way out, once its answer is sent (as
    a heap corrupted by a native bug aborts at exit: "corrupted double-linked list")."""
    multiprocessing.util.Finalize(None, os.abort, exitpriority=0)
    return _workload(training)


HEAVY_STATE_ROWS = 5_000_000


def heavy_state(training: TrainingSpec) -> Workload:
    """80 MB of parameters (an embedding table) and next to no activations: the training state
    (weights, gradients, AdamW's two moments: 320 MB) is what a process's memory holds."""
    model = nn.Sequential(nn.Embedding(HEAVY_STATE_ROWS, 4), nn.Flatten(), nn.Linear(4, CLASSES))

    def make_batch(micro_batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(0, HEAVY_STATE_ROWS, (micro_batch, 1), device=device)
        return rows, torch.randint(0, CLASSES, (micro_batch,), device=device)

    def loss_sum(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rows, labels = batch
        return nn.functional.cross_entropy(module(rows), labels, reduction="sum")

    def num_items(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return int(batch[1].shape[0])

    return Workload(model=model, make_batch=make_batch, loss_sum=loss_sum, num_items=num_items)


FACTORIES = "tests.probes_tests.factories"


def wide_spec(
    factory: str = "wide",
    *,
    features: int = 64,
    target_global_batch: int | None = 32,
    max_micro_batch: int = 128,
) -> Spec:
    return Spec(
        model=ModelSpec(factory=f"{FACTORIES}:{factory}"),
        training=TrainingSpec(
            input_shape=(features,),
            target_global_batch=target_global_batch,
            max_micro_batch=max_micro_batch,
        ),
    )


def llama_spec(layers: int) -> Spec:
    """An estimate's slow model: a narrow transformers llama of `layers` layers. At 60 its
    steps trace for tens of seconds; at thousands its build alone takes seconds (minutes in
    issue 25, before the layer replay)."""
    return Spec.model_validate(
        {
            "model": {
                "hf_config": {
                    "model_type": "llama",
                    "num_hidden_layers": layers,
                    "hidden_size": 64,
                    "num_attention_heads": 4,
                    "intermediate_size": 128,
                    "vocab_size": 256,
                }
            },
            "training": {"seq_len": 16, "target_global_batch": 64},
        }
    )
