"""The simulated CUDA card the Lightning bench (bench/integrations.py) and its test train on: a
MIG-sized slice of an A100 whose caching allocator gets `CAPACITY_BYTES` once CUDA's context,
kernels and handles are loaded, and the emulated GPU that matches it (`card_budget`).

The card keeps cuBLAS's workspaces inside its allocator for the life of the process, one set
per thread that runs matmuls: the one running forward and the optimizer, and the autograd
engine's device thread running backward (`BLAS_THREADS`, autotune.core.gpus.cuda_reserve). An
emulated GPU of the allocator's capacity less one set, as the bench first measured on, answered
a micro-batch (448) the card could not train (it trains 320): it missed the second set, and
the segments the workspaces occupy. `card_budget` holds both sets resident in the same
capacity, as the card does.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.utilities.memory import is_oom_error

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import GpuBudget, budget_for
from autotune.engine.devices.simulated_cuda import MigSlice, SimulatedCuda
from tests.autotune_tests.integrations.test_lightning import Rows, Wide

CAPACITY_BYTES = 64 * 2**20
GPU = "A100 80GB"
SM_COUNT = 14  # a 1g slice's SMs: what the context's stacks are sized by


def quiet_trainer(callback: Any = None, **options: Any) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=1,
        callbacks=[callback] if callback is not None else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def outside_allocator_bytes() -> int:
    """What the simulated CUDA holds outside its allocator after one training step of the
    module: context, kernels, handles."""
    cuda = SimulatedCuda(find_gpu(GPU), mig=MigSlice("calibration", 2**34, SM_COUNT))
    with cuda:
        quiet_trainer(BatchSizeFinder(init_val=2, max_trials=1)).fit(Wide(), datamodule=Rows())
    return cuda.outside_allocator_bytes


def simulated_card(outside_bytes: int) -> SimulatedCuda:
    return SimulatedCuda(
        find_gpu(GPU), mig=MigSlice("bench", CAPACITY_BYTES + outside_bytes, SM_COUNT)
    )


def card_budget() -> GpuBudget:
    """The card as the emulated GPU: its allocator's capacity, with the BLAS workspaces of
    both threads resident in it."""
    full = budget_for(find_gpu(GPU), world_size=1)
    total = CAPACITY_BYTES + full.reserve.outside_allocator_bytes
    return dataclasses.replace(full, gpu=dataclasses.replace(full.gpu, total_memory_bytes=total))


def fits_on_card(batch_size: int, accumulation: int, outside_bytes: int) -> bool:
    """Whether a plain fit with this batch size and accumulation trains a step on the
    simulated card, after a warm-up step at batch 2 has loaded CUDA's kernels and created the
    cuBLAS handles (with their workspaces), as a session's first steps do."""
    with simulated_card(outside_bytes):
        quiet_trainer().fit(Wide(), datamodule=Rows(batch_size=2))
        # The warm-up's trainer and module sit in reference cycles: free their storages on
        # the card before the step measured (a script fits once; this one fits twice).
        gc.collect()
        fit = quiet_trainer(accumulate_grad_batches=accumulation)
        try:
            fit.fit(Wide(), datamodule=Rows(batch_size=batch_size))
        except RuntimeError as error:
            if is_oom_error(error):  # Lightning's own test, as BatchSizeFinder's
                return False
            raise
    return fit.global_step == 1
