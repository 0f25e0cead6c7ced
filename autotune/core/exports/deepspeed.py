"""The DeepSpeed JSON for the measured run (DeepSpeed 0.19's key names, its
runtime constants), and what it cannot say.

* Precision: fp32 weights under autocast (what was measured for bf16 and fp16) are DeepSpeed's
  `torch_autocast` section; bf16 weights are its `bf16` section, which always keeps a second
  copy of the weights in the optimizer (fp32, or bf16 with ZeRO's
  `bf16_master_weights_and_grads`): the notes say how much that was not measured.
* Optimizer: AdamW as torch's (`torch_adam`), SGD (momentum 0.9) and Adafactor as torch's
  classes (DeepSpeed builds any `torch.optim` class it is named); bitsandbytes' AdamW8bit is a
  client optimizer passed to `deepspeed.initialize`, which ZeRO accepts only with
  `zero_allow_untested_optimizer` (as it does SGD and Adafactor).
* Mixed precision of the collectives: FSDP2 was measured gathering every parameter in the
  autocast dtype and reducing gradients in fp32. Under `torch_autocast` DeepSpeed gives each
  weight of its `lower_precision_safe_modules` (torch's Linear and Conv layers by default) one
  communication dtype, the autocast dtype, for both its ZeRO-3 gathers and its gradient
  reductions (`communication_data_type` does not apply to them), and moves the other parameters
  in fp32: 16-bit gathers with fp32 reductions cannot be expressed, and the notes say so.
* Sharding: ZeRO stages 1-3; hybrid sharding within groups cannot be expressed since 0.19
  removed MiCS, so hybrid is stage 3 over all ranks (less memory per rank than measured, more
  traffic across nodes), and the notes say so.
"""

from __future__ import annotations

from typing import Any

from autotune.core.exports.measured import ZERO_STAGES, MeasuredRun
from autotune.core.exports.notes import comment, shared_notes
from autotune.core.parallel.layouts import gathers_in_16_bits
from autotune.core.schemas import OptimizerName, Sharding

# Our name for each setting -> DeepSpeed's top-level key.
DEEPSPEED_KEYS = {
    "global_batch": "train_batch_size",
    "micro_batch": "train_micro_batch_size_per_gpu",
    "accumulation": "gradient_accumulation_steps",
    "bf16": "bf16",  # bf16 weights (DeepSpeed's bf16 optimizer)
    "fp16": "fp16",
    "autocast": "torch_autocast",  # fp32 weights under autocast
    "optimizer": "optimizer",
    "zero": "zero_optimization",
    "untested_optimizer": "zero_allow_untested_optimizer",
}
_K = DEEPSPEED_KEYS
# ZeRO's tested optimizers (DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS) include
# torch's AdamW; the others need the flag.
_OPTIMIZERS: dict[OptimizerName, dict[str, Any] | None] = {
    OptimizerName.ADAMW: {"type": "AdamW", "params": {"torch_adam": True, "foreach": True}},
    OptimizerName.SGD: {"type": "SGD", "params": {"momentum": 0.9, "foreach": True}},
    OptimizerName.ADAFACTOR: {"type": "Adafactor", "params": {"foreach": True}},
    OptimizerName.ADAMW_8BIT: None,  # a client optimizer: bitsandbytes' or torchao's AdamW8bit
}


def deepspeed_config(run: MeasuredRun) -> dict[str, Any]:
    config: dict[str, Any] = {
        _K["global_batch"]: run.global_batch,
        _K["micro_batch"]: run.micro_batch,
        _K["accumulation"]: run.accumulation_steps,
    }
    zero = run.sharding is not Sharding.NONE
    if run.bf16_weights:
        bf16: dict[str, Any] = {"enabled": True}
        if zero:
            # The smallest copy DeepSpeed can keep: bf16 master weights, gradients and states.
            bf16["bf16_master_weights_and_grads"] = True
            bf16["bf16_optimizer_states"] = True
        config[_K["bf16"]] = bf16
    elif run.autocast_dtype is not None:
        config[_K["autocast"]] = {"enabled": True, "dtype": run.autocast_dtype}
    optimizer = _OPTIMIZERS[run.optimizer]
    if optimizer is not None:
        config[_K["optimizer"]] = {"type": optimizer["type"], "params": dict(optimizer["params"])}
    if zero:
        config[_K["zero"]] = {"stage": ZERO_STAGES[run.sharding]}
        if run.optimizer is not OptimizerName.ADAMW:
            config[_K["untested_optimizer"]] = True
    return config


def deepspeed_notes(run: MeasuredRun) -> str:
    """What the JSON (which has no comments) cannot say: the notes every export carries, and
    what DeepSpeed holds beyond the measured run."""
    lines: list[str] = []
    if run.optimizer is OptimizerName.ADAMW_8BIT:
        eight_bit = run.eight_bit_adamw
        lines += [
            f"The optimizer is {eight_bit.library}'s AdamW8bit (the one measured), passed to "
            "DeepSpeed",
            "as a client optimizer:",
            f"    import {eight_bit.library}.optim",
            f"    optimizer = {eight_bit.class_path}(model.parameters(), lr=...)",
            "    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, "
            "config=ds_config)",
        ]
    if run.bf16_weights:
        copy = (
            [
                "keeps a bf16 master copy of its partition of the weights and gradients (2",
                "bytes per parameter each, divided by the ranks),",
            ]
            if run.sharding is not Sharding.NONE
            else [
                "keeps an fp32 master copy of the weights and of the gradients (8 bytes per",
                "parameter; bf16 master weights need ZeRO),",
            ]
        )
        lines += [
            "bf16 weights with no second copy cannot be expressed: DeepSpeed's bf16 optimizer",
            *copy,
            "which was not measured, and runs without autocast. Leave it room.",
        ]
    if run.fsdp2 and gathers_in_16_bits(run.training):
        dtype = run.autocast_dtype
        lines += [
            "Under torch_autocast DeepSpeed gathers (ZeRO-3) the Linear layers' weights and",
            f"reduces their gradients in {dtype}, the other parameters' in fp32",
            "(communication_data_type does not apply to them). Measured: FSDP2 gathering every",
            f"parameter in {dtype} and reducing gradients in fp32, which cannot be expressed.",
        ]
    if run.sharding is Sharding.HYBRID:
        lines += [
            f"Hybrid sharding (groups of {run.shard_group_size}) cannot be expressed: DeepSpeed "
            "0.19 removed MiCS,",
            f"its only way to shard within groups. This is ZeRO-3 over all {run.world_size} "
            "ranks: less memory per",
            "rank than measured, but every all-gather crosses the nodes.",
        ]
    return "# DeepSpeed: what the JSON cannot say\n" + comment(shared_notes(run) + lines)
