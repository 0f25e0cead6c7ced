"""`AutotuneBatchSize` in a real `lightning.Trainer`: at fit start it sets the datamodule's batch
size, the trainer's accumulation and keeps the global batch asked for; the fit then trains on
batches of that size (autotune/integrations/lightning.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune.core.errors import SpecError
from autotune.core.schemas import OptimizerName
from autotune.integrations.lightning import AutotuneBatchSize

# 24 MiB before the emulated GPU placed the residents where the warm-up leaves them: from that
# placement an accumulating step (an earlier micro-batch's gradients held) runs out there even
# at micro-batch 1 (128 fit without accumulation), so the target's accumulation needs more.
MEMORY_BYTES = 28 * 2**20
TARGET_GLOBAL_BATCH = 512


class Wide(LightningModule):
    """A classifier with one wide hidden layer: about 100 KiB of activations per sample, so a
    few MiB of emulated GPU hold far fewer samples than the global batch."""

    def __init__(self, width: int = 8192) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        self.seen.append(int(inputs.shape[0]))
        loss = nn.functional.cross_entropy(self.net(inputs), targets)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Rows(LightningDataModule):
    def __init__(self, batch_size: int = 4, count: int = 2048) -> None:
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(count, 64, generator=generator),
            torch.randint(0, 10, (count,), generator=generator),
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size)


def trainer(callback: Any, max_steps: int = 2) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


@pytest.mark.e2e
def test_fit_trains_with_the_tuned_batch_and_keeps_the_global_batch() -> None:
    callback = AutotuneBatchSize(
        target_global_batch=TARGET_GLOBAL_BATCH,
        memory=MEMORY_BYTES,
        trials=2,
        seconds_per_trial=0.05,
    )
    module, data = Wide(), Rows()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    fit = trainer(callback)
    fit.fit(module, datamodule=data)
    micro = callback.optimal_batch_size
    assert micro is not None and callback.result is not None
    rec = callback.result.recommendation
    assert rec is not None and not rec.checkpointing  # nothing in the module to switch
    # The datamodule's attribute and the trainer's accumulation, set; the target kept exactly.
    assert data.batch_size == micro
    assert fit.accumulate_grad_batches == rec.accumulation_steps > 1
    assert micro * fit.accumulate_grad_batches == TARGET_GLOBAL_BATCH
    # The fit trained the live module (not the probe's copy) on batches of the tuned size.
    assert fit.global_step == 2
    assert module.seen == [micro] * (2 * rec.accumulation_steps)
    assert any(not torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert module.trainer is fit


def test_an_unmeasured_optimizer_is_refused_by_name() -> None:
    class Rprop(Wide):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Rprop(self.parameters())

    callback = AutotuneBatchSize(target_global_batch=8, memory=MEMORY_BYTES)
    with pytest.raises(SpecError, match="optimizer: Rprop"):
        trainer(callback).fit(Rprop(width=16), datamodule=Rows(count=16))


def test_a_missing_batch_size_attribute_is_refused_by_name() -> None:
    callback = AutotuneBatchSize(target_global_batch=8, memory=MEMORY_BYTES, batch_arg_name="bs")
    with pytest.raises(SpecError, match="batch_arg_name: 'bs'"):
        trainer(callback).fit(Wide(width=16), datamodule=Rows(count=16))


@pytest.mark.e2e
def test_the_probes_largest_micro_batch_trains_on_the_simulated_card() -> None:
    """The probe on the emulated GPU that matches the simulated card (its allocator, with the
    cuBLAS workspaces of the forward and the backward thread resident, `card_budget`) answers
    what a plain Lightning fit on the card trains: its largest micro-batch trains there, one
    more runs out. Given the capacity less one set of workspaces instead, the probe answered
    448, which the card cannot train (bench/results/integrations.md before the fix)."""
    from autotune import probe
    from autotune.integrations.lightning import training_step_loss
    from tests.autotune_tests.integrations.lightning_card import (
        card_budget,
        fits_on_card,
        outside_allocator_bytes,
    )

    batch = next(iter(Rows().train_dataloader()))
    result = probe(
        model=Wide(),
        batch=batch,
        loss=training_step_loss,
        gpu=card_budget(),
        optimizer=OptimizerName.ADAMW,
        max_micro_batch=1024,
    )
    largest = result.modes[0].max_micro_batch
    outside = outside_allocator_bytes()
    assert fits_on_card(largest, 1, outside)
    assert not fits_on_card(largest + 1, 1, outside)
    assert not fits_on_card(448, 1, outside)
