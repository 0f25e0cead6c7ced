"""Axolotl YAML keys for the measured run, and their paste-ready text.

Every key name comes from `AXOLOTL_KEYS`, read from Axolotl's own config schema
(`axolotl/utils/schemas/{config,training,peft,fsdp}.py` and `utils/config/__init__.py`) in the
release named by `AXOLOTL_VERSION`; the round-trip tests validate each export with that
release's `validate_config`.

What Axolotl cannot express, said in the text:

* fp32 weights under autocast: `bf16: true` (and `fp16: true`) also load the weights in that
  dtype (`resolve_dtype`), so an autocast spec becomes a bf16-weights run (less memory than
  measured); Axolotl's default `bf16: auto` would do the same to an fp32 spec, so every export
  sets both flags.
* fp32 gradient reductions under FSDP2 (measured with 16-bit gathers): Axolotl shards through
  accelerate, whose `bf16`/`fp16` policy reduces gradients in that dtype, and no Axolotl key
  sets the policy (its `fsdp_config.mixed_precision_policy` reaches no FSDP argument).
* a fractional `lora_alpha` (its schema takes an integer): rounded, and the text says so.
* partial checkpointing: Axolotl checkpoints every layer (more recompute, no more memory).
* DDP's `gradient_as_bucket_view` (no key): one more gradient copy than measured.
* bitsandbytes' AdamW8bit: `adamw_bnb_8bit` is the Trainer's bitsandbytes AdamW with 8-bit
  states but 32-bit ones for the embeddings.
"""

from __future__ import annotations

from typing import Any

import yaml

from autotune.core.exports.deepspeed import deepspeed_config
from autotune.core.exports.measured import MeasuredRun
from autotune.core.exports.notes import OLD_ALLOCATOR_VARIABLE, comment, shared_notes
from autotune.core.parallel.layouts import gathers_in_16_bits
from autotune.core.schemas import OptimizerName, Precision, Sharding

AXOLOTL_VERSION = "0.19.0"
# Our name for each setting -> Axolotl's key, as its schema names it in AXOLOTL_VERSION.
AXOLOTL_KEYS = {
    "micro_batch": "micro_batch_size",
    "accumulation": "gradient_accumulation_steps",
    "checkpointing": "gradient_checkpointing",
    "bf16": "bf16",  # Literal["auto"] | bool; true also loads the weights in bf16
    "fp16": "fp16",
    "tf32": "tf32",
    "optimizer": "optimizer",  # transformers' OptimizerNames values
    "optimizer_args": "optim_args",  # str | dict, passed to the Trainer as optim_args
    "adapter": "adapter",
    "lora_r": "lora_r",
    "lora_alpha": "lora_alpha",  # int | None
    "lora_dropout": "lora_dropout",
    "lora_target_modules": "lora_target_modules",  # str | list[str], passed to LoraConfig
    "lora_modules_to_save": "lora_modules_to_save",
    "sequence_len": "sequence_len",
    "sample_packing": "sample_packing",
    "deepspeed": "deepspeed",  # str (a path) | dict
    "fsdp_version": "fsdp_version",
    "fsdp_config": "fsdp_config",  # reshard_after_forward: bool, auto_wrap_policy
    "dp_shard_size": "dp_shard_size",
    "dp_replicate_size": "dp_replicate_size",
}
_K = AXOLOTL_KEYS
OPTIMIZERS = {
    OptimizerName.ADAMW: "adamw_torch",
    OptimizerName.SGD: "sgd",
    OptimizerName.ADAFACTOR: "adafactor",
    OptimizerName.ADAMW_8BIT: "adamw_bnb_8bit",  # torchao's adamw_torch_8bit under FSDP2
}


def axolotl_config(run: MeasuredRun) -> dict[str, Any]:
    training = run.training
    config: dict[str, Any] = {
        _K["micro_batch"]: run.micro_batch,
        _K["accumulation"]: run.accumulation_steps,
        _K["checkpointing"]: run.checkpointing,
        # Axolotl's bf16 loads the weights in bf16 and trains them so, under bf16 autocast.
        _K["bf16"]: training.precision is Precision.BF16,
        _K["fp16"]: training.precision is Precision.FP16,
    }
    if training.tf32 is not None:
        config[_K["tf32"]] = training.tf32
    config[_K["optimizer"]] = OPTIMIZERS[run.optimizer]
    if run.optimizer is OptimizerName.ADAMW_8BIT:
        config[_K["optimizer"]] = run.eight_bit_adamw.hf_optim
    if run.optimizer is OptimizerName.SGD:
        config[_K["optimizer_args"]] = {"momentum": 0.9}
    lora = run.lora
    if lora is not None:
        config[_K["adapter"]] = "lora"
        config[_K["lora_r"]] = lora["r"]
        config[_K["lora_alpha"]] = max(1, round(lora["lora_alpha"]))
        config[_K["lora_dropout"]] = lora["lora_dropout"]
        # A string is passed to peft as is: "all-linear" is peft's rule, which on the
        # transformers models Axolotl loads leaves out the output head, as measured.
        targets = lora["target_modules"]
        config[_K["lora_target_modules"]] = targets if isinstance(targets, str) else list(targets)
        if "modules_to_save" in lora:
            config[_K["lora_modules_to_save"]] = list(lora["modules_to_save"])
    if run.tokens_per_sample is not None:
        config[_K["sequence_len"]] = run.tokens_per_sample
        config[_K["sample_packing"]] = True
    if run.sharding is Sharding.ZERO1:
        config[_K["deepspeed"]] = deepspeed_config(run)
    elif run.fsdp2:
        config[_K["fsdp_version"]] = 2
        config[_K["fsdp_config"]] = {
            "reshard_after_forward": run.sharding is not Sharding.ZERO2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        }
        if run.sharding is Sharding.HYBRID:
            config[_K["dp_shard_size"]] = run.shard_group_size
            config[_K["dp_replicate_size"]] = run.world_size // run.shard_group_size
    return config


def render_axolotl(run: MeasuredRun, config: dict[str, Any]) -> str:
    return (
        f"# Axolotl config (merge into your YAML); keys of Axolotl {AXOLOTL_VERSION}\n"
        + comment(shared_notes(run) + _notes(run, config))
        + yaml.safe_dump(config, sort_keys=False)
    )


def _notes(run: MeasuredRun, config: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if run.precision is not Precision.FP32 and not run.bf16_weights:
        dtype = run.precision.value
        lines += [
            f"Measured with fp32 weights under {dtype} autocast, which Axolotl cannot express: "
            f"{dtype}: true",
            f"also loads the weights in {dtype} (less memory than measured, no fp32 master copy).",
        ]
        if run.precision is Precision.FP16 and run.lora is None:
            lines.append(
                "Full fine-tuning of fp16 weights fails in the gradient scaler: use bf16 or LoRA."
            )
    if run.fsdp2 and gathers_in_16_bits(run.training):
        lines += [
            f"FSDP2 here gathers parameters and reduces gradients in {run.autocast_dtype} "
            "(accelerate's "
            f"{run.precision.value} policy;",
            "no Axolotl key sets another): measured reducing them in fp32.",
        ]
    # Axolotl's CLI sets the allocator's settings as it starts (`set_pytorch_cuda_alloc_conf`):
    # expandable segments in PYTORCH_ALLOC_CONF when it is unset, else expandable segments
    # with roundup_power2_divisions:16 in PYTORCH_CUDA_ALLOC_CONF, which torch reads first,
    # unless that is set: only PYTORCH_CUDA_ALLOC_CONF keeps the measured settings.
    conf = run.allocator_conf or "expandable_segments:False"
    lines += [
        "Axolotl's CLI sets expandable segments as it starts (not measured; they can fit less)",
        f"unless {OLD_ALLOCATOR_VARIABLE} is set: launch with",
        f"{OLD_ALLOCATOR_VARIABLE}={conf} axolotl train config.yml",
    ]
    if run.optimizer is OptimizerName.ADAMW_8BIT and run.fsdp2:
        lines.append("adamw_torch_8bit is torchao's AdamW8bit, measured for FSDP2 shards.")
    elif run.optimizer is OptimizerName.ADAMW_8BIT:
        lines += [
            "adamw_bnb_8bit is the Trainer's bitsandbytes AdamW(optim_bits=8), which keeps the",
            "embeddings' states in 32 bits (8 bytes per element where bitsandbytes' AdamW8bit,",
            "measured, keeps 2): Axolotl cannot name that class. Leave the room: 6 bytes per",
            "embedding element.",
        ]
    lora = run.lora
    if lora is not None and config[_K["lora_alpha"]] != lora["lora_alpha"]:
        lines.append(
            f"lora_alpha {lora['lora_alpha']} was measured; Axolotl takes an integer, so "
            f"{config[_K['lora_alpha']]}: the update's scale differs (memory and speed do not)."
        )
    if run.checkpointed_blocks is not None:
        lines += [
            f"Measured with the first {run.checkpointed_blocks} layers checkpointed; Axolotl "
            "checkpoints every",
            "layer (gradient_checkpointing: true): the same memory or less, more recompute.",
        ]
    if run.world_size > 1 and run.sharding is Sharding.NONE:
        lines += [
            "On several ranks the memory was measured for DDP with gradient_as_bucket_view=True,",
            "which no Axolotl key sets: its runs keep DDP's default and hold one more copy of",
            "the gradients (4 bytes per fp32 parameter) at the end of backward and in the",
            "optimizer step. Leave that much free, e.g. a smaller micro_batch_size.",
        ]
    if run.sharding is Sharding.ZERO1:
        lines.append(
            "ZeRO-1 through DeepSpeed (the DeepSpeed export); measured: DDP with "
            "ZeroRedundancyOptimizer."
        )
    return lines
