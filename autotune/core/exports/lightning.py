"""Lightning (2.6) arguments for the measured run, and their paste-ready text.

Lightning splits them over three objects: the Trainer owns accumulation, precision and the
strategy; the datamodule owns the batch size; checkpointing, adapters and the optimizer live in
the LightningModule (the text shows its `configure_model` and `configure_optimizers`).

* Precision: `bf16-mixed` / `16-mixed` autocast, as measured; bf16 weights are loaded in bf16 by
  the module and trained under `bf16-mixed` (not `bf16-true`, which would also turn fp32 LoRA
  adapters to bf16 and run without autocast).
* DDP (and ZeRO-1, measured as DDP with torch's ZeroRedundancyOptimizer, which the module
  returns): `DDPStrategy(gradient_as_bucket_view=True)`.
* FSDP2 (zero2, zero3, hybrid): `ModelParallelStrategy`, with `fully_shard` on each block, then
  the root, in `configure_model` (hybrid over a 2-D replicate x shard mesh). Lightning's
  `FSDPStrategy` is FSDP1.
"""

from __future__ import annotations

from typing import Any

from autotune.core.exports.hf import partial_lines
from autotune.core.exports.measured import MeasuredRun, lora_snippet
from autotune.core.exports.notes import allocator_lines, comment, shared_notes
from autotune.core.parallel.layouts import gathers_in_16_bits
from autotune.core.schemas import Precision, Sharding

DDP_KWARGS = {"gradient_as_bucket_view": True}
_PRECISIONS = {Precision.FP32: "32-true", Precision.BF16: "bf16-mixed", Precision.FP16: "16-mixed"}


def lightning_arguments(run: MeasuredRun) -> dict[str, Any]:
    # What configure_optimizers returns.
    optimizer, kwargs = run.optimizer_class
    module: dict[str, Any] = {
        "gradient_checkpointing": run.checkpointing,
        "optimizer": optimizer,
        "optimizer_kwargs": kwargs,
    }
    lightning: dict[str, Any] = {
        "trainer": {
            "accumulate_grad_batches": run.accumulation_steps,
            "precision": _PRECISIONS[run.precision],
        },
        "datamodule": {"batch_size": run.micro_batch},
        "module": module,
    }
    training = run.training
    if training.tf32 is not None:
        # Lightning has no Trainer flag: the module sets torch's matmul precision.
        module["float32_matmul_precision"] = "high" if training.tf32 else "highest"
    if run.bf16_weights:
        module["weights_dtype"] = "bfloat16"
    if run.sharding is Sharding.ZERO1:
        module["zero_redundancy_optimizer"] = True
    if run.lora is not None:
        module["lora"] = run.lora
    if run.checkpointed_blocks is not None:
        module["checkpointed_blocks"] = run.checkpointed_blocks
    if run.fsdp2:
        lightning["model_parallel_strategy"] = {
            "data_parallel_size": run.world_size,
            "tensor_parallel_size": 1,
        }
        module["fully_shard"] = {
            "reshard_after_forward": run.sharding is not Sharding.ZERO2,
            # FSDP2's mixed precision, as measured (`gathers_in_16_bits`): None, without.
            "param_dtype": run.autocast_dtype if gathers_in_16_bits(run.training) else None,
            "mesh_shape": [run.world_size // run.shard_group_size, run.shard_group_size]
            if run.sharding is Sharding.HYBRID
            else [run.world_size],
        }
    elif run.world_size > 1:
        # The Trainer's `strategy`: DDPStrategy passes these to DDP.
        lightning["ddp_strategy"] = dict(DDP_KWARGS)
    return lightning


def _kwargs(values: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in values.items())


def render_lightning(run: MeasuredRun, lightning: dict[str, Any]) -> str:
    trainer_kwargs = _kwargs(lightning["trainer"])
    strategy_import = ""
    if "ddp_strategy" in lightning:
        trainer_kwargs += f", strategy=DDPStrategy({_kwargs(lightning['ddp_strategy'])})"
        strategy_import = "from lightning.pytorch.strategies import DDPStrategy\n"
    elif "model_parallel_strategy" in lightning:
        strategy = _kwargs(lightning["model_parallel_strategy"])
        trainer_kwargs += f", strategy=ModelParallelStrategy({strategy})"
        strategy_import = "from lightning.pytorch.strategies import ModelParallelStrategy\n"
    module = lightning["module"]
    lines = _configure_model_lines(run, module) + _configure_optimizers_lines(module)
    matmul_precision = module.get("float32_matmul_precision")
    tail = (
        f"import torch\ntorch.set_float32_matmul_precision({matmul_precision!r})\n"
        if matmul_precision is not None
        else ""
    )
    return (
        "# Lightning: the Trainer owns accumulation and precision; batch_size is per rank, in\n"
        "# your datamodule; the rest lives in your LightningModule (below).\n"
        + comment(shared_notes(run))
        + allocator_lines(run)
        + f"import lightning as L\n{strategy_import}\n"
        f"trainer = L.Trainer({trainer_kwargs})\n"
        f"datamodule = YourDataModule({_kwargs(lightning['datamodule'])})\n"
        + comment(lines)
        + tail
    )


def _configure_model_lines(run: MeasuredRun, module: dict[str, Any]) -> list[str]:
    """The LightningModule's configure_model, as comment lines (for a Hugging Face model in
    self.model)."""
    body: list[str] = []
    if module.get("weights_dtype") == "bfloat16":
        body += [
            "# bf16 weights, no fp32 master copy (or load them so: from_pretrained(...,",
            "# dtype=torch.bfloat16)); bf16-mixed then autocasts, as measured.",
            "self.model.to(torch.bfloat16)",
        ]
    count = module.get("checkpointed_blocks")
    if count is not None:
        body.append(f"# Activation checkpointing of the first {count} layers, as measured:")
        body += partial_lines(count, "self.model")
    elif module["gradient_checkpointing"]:
        body += [
            "# Activation checkpointing: ON (Lightning has no Trainer flag for it).",
            "self.model.gradient_checkpointing_enable(",
            '    gradient_checkpointing_kwargs={"use_reentrant": False}',
            ")",
        ]
    else:
        body.append("# Activation checkpointing: off (Lightning has no Trainer flag for it).")
    lora = module.get("lora")
    if lora is not None:
        body.append("# LoRA adapters as measured (peft keeps them fp32 on a bf16 model):")
        body += lora_snippet(lora, model="self.model").splitlines()
    shard = module.get("fully_shard")
    if shard is not None:
        body += _fully_shard_lines(run, shard)
    if all(line.startswith("#") for line in body):
        body.append("pass")
    return ["def configure_model(self):"] + [f"    {line}" for line in body]


def _fully_shard_lines(run: MeasuredRun, shard: dict[str, Any]) -> list[str]:
    reshard = shard["reshard_after_forward"]
    if run.sharding is Sharding.HYBRID:
        replicate, group = shard["mesh_shape"]
        mesh = [
            "from torch.distributed.device_mesh import init_device_mesh",
            f"# Hybrid: sharded within groups of {group} ranks, replicated across {replicate}.",
            f'mesh = init_device_mesh("cuda", ({replicate}, {group}), '
            'mesh_dim_names=("replicate", "shard"))',
        ]
    else:
        mesh = ['mesh = self.device_mesh["data_parallel"]']
    kwargs = f"mesh=mesh, reshard_after_forward={reshard}"
    policy = []
    if shard.get("param_dtype") is not None:
        kwargs += ", mp_policy=mp_policy"
        policy = [
            "# Weights gathered in 16 bits, gradients reduced in fp32, as measured.",
            f"mp_policy = MixedPrecisionPolicy(param_dtype=torch.{shard['param_dtype']}, "
            "reduce_dtype=torch.float32)",
        ]
    return [
        "# FSDP2 as measured: every block its own unit, then the root.",
        "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard"
        if policy
        else "from torch.distributed.fsdp import fully_shard",
        *mesh,
        *policy,
        "for block in self.model.model.layers:  # your model's blocks",
        f"    fully_shard(block, {kwargs})",
        f"fully_shard(self.model, {kwargs})",
    ]


def _configure_optimizers_lines(module: dict[str, Any]) -> list[str]:
    optimizer = module["optimizer"]
    kwargs = module["optimizer_kwargs"]
    extra = "".join(f", {key}={value!r}" for key, value in kwargs.items())
    if module.get("zero_redundancy_optimizer"):
        build = [
            "# ZeRO-1 as measured: each rank the optimizer states of its share of the parameters.",
            "from torch.distributed.optim import ZeroRedundancyOptimizer",
            "trainable = [p for p in self.parameters() if p.requires_grad]",
            f"return ZeroRedundancyOptimizer(trainable, optimizer_class={optimizer}, "
            f"lr=...{extra})",
        ]
    else:
        build = [
            "# The optimizer as measured:",
            "trainable = [p for p in self.parameters() if p.requires_grad]",
            f"return {optimizer}(trainable, lr=...{extra})",
        ]
    library = optimizer.split(".")[0]
    if library != "torch":
        build.insert(0, f"import {library}.optim")
    return ["def configure_optimizers(self):"] + [f"    {line}" for line in build]
