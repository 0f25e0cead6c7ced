"""`AutotuneBatchSize`: a Lightning callback in place of `BatchSizeFinder`
(docs/design.md#the-python-api).

    trainer = L.Trainer(callbacks=[AutotuneBatchSize(target_global_batch=64, gpu="H100 80GB")])
    trainer.fit(module, datamodule)

At fit start it takes one real batch from the train dataloader (the datamodule's, else the
module's, as `BatchSizeFinder` requires), tunes on a copy of the live module with it
(`autotune.tune`; the loss is the module's own `training_step`), and sets what the
recommendation says on the live objects: the batch size attribute (`batch_arg_name`, found where
`BatchSizeFinder` finds it: the module, its hparams, the datamodule), the trainer's
`accumulate_grad_batches`, and checkpointing. The global batch asked for is kept exactly:
micro-batch x accumulation x world size. `BatchSizeFinder` instead doubles one batch size until
a step runs out and keeps no target (docs/design.md#the-python-api).

Checkpointing is set only where autotune can switch it: a transformers model inside the
module (`supports_gradient_checkpointing`), whose `gradient_checkpointing_enable` (or first k
layers) it calls; a module without one is tuned without checkpointing.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

from autotune.core.errors import SpecError
from autotune.core.gpus.cuda_reserve import GpuBudget
from autotune.core.schemas import OptimizerName, Precision, Recommendation, TuneResult

# Lightning's precision names (`Trainer(precision=...)`) that autotune measures.
_PRECISIONS = {
    "32-true": Precision.FP32,
    "32": Precision.FP32,
    "bf16-mixed": Precision.BF16,
    "16-mixed": Precision.FP16,
}
# torch's optimizers and the measured optimizer with the same state per parameter (Adam keeps
# AdamW's two moments; SGD is measured with momentum, at most what plain SGD keeps).
_OPTIMIZERS = {
    "Adam": OptimizerName.ADAMW,
    "AdamW": OptimizerName.ADAMW,
    "SGD": OptimizerName.SGD,
    "Adafactor": OptimizerName.ADAFACTOR,
}


class AutotuneBatchSize(Callback):
    """Tunes the micro-batch, `accumulate_grad_batches` and checkpointing at fit start so that
    micro-batch x accumulation x world size is `target_global_batch`.

    Args:
        target_global_batch: the samples per optimizer step to keep.
        batch_arg_name: the batch size attribute, as `BatchSizeFinder`'s.
        device, memory, gpu: where to measure, as `autotune.tune` ("cuda", "cuda:N", or the
            emulated GPU of `memory` bytes, or of the named `gpu` or its `GpuBudget`).
        trials, seconds_per_trial: the tuner's budget, as `autotune.tune`.
        server, token, wait_s: ask this autotune server instead of measuring here: its stored
            recommendation for the module on the emulated GPU of `memory` or `gpu`, or with
            neither on this machine's CUDA `device`, answers at once
            (`autotune.python_api.stored_recommendation`; none stored: AutotuneError).

    After `fit` starts, `optimal_batch_size` is the micro-batch set (as `BatchSizeFinder`'s),
    `recommendation` what was applied, and `result` the `TuneResult` (None from a server).
    """

    def __init__(
        self,
        target_global_batch: int,
        *,
        batch_arg_name: str = "batch_size",
        device: str | None = None,
        memory: int | None = None,
        gpu: str | GpuBudget | None = None,
        trials: int | None = None,
        seconds_per_trial: float = 1.0,
        server: str | None = None,
        token: str | None = None,
        wait_s: float = 0,
    ) -> None:
        if target_global_batch < 1:
            raise SpecError(f"target_global_batch: must be >= 1, got {target_global_batch}")
        if server is not None and isinstance(gpu, GpuBudget):
            raise SpecError("gpu: a server stores results under a GPU's name, not a GpuBudget")
        self.target_global_batch = target_global_batch
        self._batch_arg_name = batch_arg_name
        self._device = device
        self._memory = memory
        self._gpu = gpu
        self._trials = trials
        self._seconds_per_trial = seconds_per_trial
        self._server = server
        self._token = token
        self._wait_s = wait_s
        self.optimal_batch_size: int | None = None
        self.result: TuneResult | None = None
        self.recommendation: Recommendation | None = None

    def setup(
        self, trainer: Trainer, pl_module: LightningModule, stage: str | None = None
    ) -> None:
        # BatchSizeFinder's own refusals, for the same reasons: one probe per rank could differ
        # between ranks, and a dataloader passed to fit() has no batch size attribute to set.
        if trainer._accelerator_connector.is_distributed:
            raise SpecError("AutotuneBatchSize: distributed strategies are not supported")
        if not trainer.fit_loop._data_source.is_module():
            raise SpecError(
                "AutotuneBatchSize: give the dataloader by the LightningModule or a "
                "LightningDataModule, not to fit(): its batch size attribute is what is set"
            )
        if not lightning_hasattr(pl_module, self._batch_arg_name):
            raise SpecError(
                f"batch_arg_name: {self._batch_arg_name!r} not found in the module, its "
                "hparams, or the datamodule"
            )
        if not pl_module.automatic_optimization:
            raise SpecError("AutotuneBatchSize: manual optimization is not supported")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from autotune.python_api import live_spec, recommendation_of, stored_recommendation, tune

        batch = first_batch(trainer, pl_module)
        fields = training_fields(trainer, self.target_global_batch)
        if self._server is not None:
            self.recommendation = stored_recommendation(
                live_spec(pl_module, batch, fields),
                server=self._server,
                token=self._token,
                memory=self._memory,
                gpu=self._gpu if isinstance(self._gpu, str) else None,
                wait_s=self._wait_s,
                device=self._device,
            )
        else:
            # The copy the trials train must not drag the trainer (its loaders, loggers) along.
            pl_module.trainer = None
            try:
                self.result = tune(
                    model=pl_module,
                    batch=batch,
                    loss=training_step_loss,
                    device=self._device,
                    memory=self._memory,
                    gpu=self._gpu,
                    trials=self._trials,
                    seconds_per_trial=self._seconds_per_trial,
                    **fields,
                )
            finally:
                pl_module.trainer = trainer
            self.recommendation = recommendation_of(self.result, "AutotuneBatchSize")
        apply(trainer, pl_module, self.recommendation, self._batch_arg_name)
        self.optimal_batch_size = self.recommendation.micro_batch


def first_batch(trainer: Trainer, pl_module: LightningModule) -> Any:
    """One batch of the train dataloader the fit will use (the datamodule's, else the
    module's), as `training_step` receives it."""
    # `trainer.datamodule` is set by fit(), not declared on the class.
    datamodule = getattr(trainer, "datamodule", None)
    source = datamodule if datamodule is not None else pl_module
    loader = source.train_dataloader()
    try:
        return next(iter(loader))
    except StopIteration:
        raise SpecError("train_dataloader: empty; the probe needs one real batch") from None


def training_fields(trainer: Trainer, target_global_batch: int) -> dict[str, Any]:
    """The spec's training fields the trainer says: precision, optimizer, world size.

    Raises:
        SpecError: a precision or an optimizer autotune does not measure, naming it.
    """
    precision = _PRECISIONS.get(str(trainer.precision))
    if precision is None:
        known = ", ".join(_PRECISIONS)
        raise SpecError(f"precision: {trainer.precision!r}: autotune measures {known}")
    optimizers = trainer.optimizers
    if len(optimizers) != 1:
        raise SpecError(f"optimizer: one is supported, the module has {len(optimizers)}")
    kind = type(optimizers[0]).__name__
    optimizer = _OPTIMIZERS.get(kind)
    if optimizer is None:
        raise SpecError(f"optimizer: {kind}: autotune measures {', '.join(_OPTIMIZERS)}")
    return {
        "target_global_batch": target_global_batch,
        "world_size": trainer.world_size,
        "precision": precision,
        "optimizer": optimizer,
    }


def training_step_loss(module: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss the module's own `training_step` returns (a tensor, or a dict's "loss")."""
    assert isinstance(module, LightningModule)
    with warnings.catch_warnings():
        # The copy has no trainer to log to; its self.log calls are dropped, as they should be.
        warnings.filterwarnings("ignore", message=".*self.log.*")
        output = module.training_step(batch, 0)
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise SpecError("training_step: returns no loss (a tensor, or a dict with 'loss')")
    return loss


def apply(
    trainer: Trainer, pl_module: LightningModule, rec: Recommendation, batch_arg_name: str
) -> None:
    """Sets the recommendation on the live objects."""
    lightning_setattr(pl_module, batch_arg_name, rec.micro_batch)
    trainer.accumulate_grad_batches = rec.accumulation_steps
    set_checkpointing(pl_module, rec)
    # As BatchSizeFinder does after changing the size: the loaders are built again from it.
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    loop.epoch_loop.val_loop._combined_loader = None
    loop.epoch_loop.val_loop.setup_data()


def set_checkpointing(pl_module: LightningModule, rec: Recommendation) -> None:
    """Checkpointing on the module's transformers model as recommended (all layers or the
    first k); a module without one was tuned without checkpointing, so nothing to set."""
    from autotune.python_api import checkpointable_module

    checkpointable = checkpointable_module(pl_module)
    if checkpointable is None:
        return
    from autotune.engine.training.workload import hf_checkpointing

    switch = hf_checkpointing(checkpointable)
    switch(rec.checkpointing)
    switch.limit(rec.checkpointed_blocks)
