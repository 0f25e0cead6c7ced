"""The run that was measured, as every consumer's export reads it: the recommendation's numbers
and the spec's training setup, in one plain record (`MeasuredRun`), and the peft `LoraConfig`
arguments that rebuild the measured adapters.

Everything an export says comes from here, so that the server can rebuild the exports from a
stored spec and recommendation alone: no hidden inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.core.memory.optimizer_states import FSDP2_SHARDINGS, EightBitAdamW, eight_bit_adamw
from autotune.core.schemas import (
    OptimizerName,
    Precision,
    Recommendation,
    Sharding,
    TrainingSpec,
    WeightsDtype,
)

# The name the measured model's output head has, which "all-linear" adapters leave out
# (autotune.engine.training.adapters: peft itself leaves it out only on transformers models).
OUTPUT_HEAD = "lm_head"
# DeepSpeed's ZeRO stage for each sharding; hybrid is stage 3 over all ranks there (DeepSpeed
# 0.19 removed MiCS, its only way to shard within groups: the DeepSpeed text says so).
ZERO_STAGES = {Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.ZERO3: 3, Sharding.HYBRID: 3}
# torch's name of the dtype each mixed precision autocasts to (fp32 runs without autocast).
_AUTOCAST_DTYPES = {Precision.BF16: "bfloat16", Precision.FP16: "float16"}
# The optimizer class each measured optimizer was built as, with its keyword arguments (but the
# learning rate); the 8-bit AdamW's class depends on the sharding (`MeasuredRun.eight_bit_adamw`).
_OPTIMIZER_CLASSES: dict[OptimizerName, tuple[str, dict[str, Any]]] = {
    OptimizerName.ADAMW: ("torch.optim.AdamW", {"foreach": True}),
    OptimizerName.SGD: ("torch.optim.SGD", {"momentum": 0.9, "foreach": True}),
    OptimizerName.ADAFACTOR: ("torch.optim.Adafactor", {"foreach": True}),
}


@dataclass(frozen=True)
class MeasuredRun:
    """What was measured: one rank's micro-batch, accumulation and rank count, checkpointing,
    and the training setup (precision, weights, optimizer, adapters, sharding)."""

    micro_batch: int
    accumulation_steps: int
    world_size: int
    global_batch: int
    checkpointing: bool
    checkpointed_blocks: int | None  # partial checkpointing: the first this many blocks
    num_blocks: int | None
    training: TrainingSpec
    token_model: bool
    runs_out_below: tuple[int, ...] = ()  # smaller micro-batches that run out
    allocator_conf: str | None = None  # PYTORCH_ALLOC_CONF measured (None: torch's defaults)

    @classmethod
    def of(
        cls,
        rec: Recommendation,
        training: TrainingSpec | None,
        *,
        token_model: bool,
        device_allocator_conf: str | None = None,
    ) -> MeasuredRun:
        """`device_allocator_conf`: the measuring device's allocator settings, which hold
        unless the recommendation's own do (its expandable segments add to them).

        Raises:
        ValueError: when `rec.global_batch` is not micro-batch * accumulation * world size."""
        b, accumulation, world = rec.micro_batch, rec.accumulation_steps, rec.world_size
        if b * accumulation * world != rec.global_batch:
            raise ValueError(
                f"inconsistent recommendation: {b} * {accumulation} * {world} != "
                f"{rec.global_batch}"
            )
        partial = rec.checkpointed_blocks if rec.checkpointing else None
        return cls(
            micro_batch=b,
            accumulation_steps=accumulation,
            world_size=world,
            global_batch=rec.global_batch,
            checkpointing=rec.checkpointing,
            checkpointed_blocks=partial,
            num_blocks=rec.num_blocks if partial is not None else None,
            training=training or TrainingSpec(),
            token_model=token_model,
            runs_out_below=tuple(rec.runs_out_below),
            allocator_conf=rec.allocator_conf or device_allocator_conf,
        )

    @property
    def precision(self) -> Precision:
        return self.training.precision

    @property
    def autocast_dtype(self) -> str | None:
        """torch's name of the dtype the step autocasts to; None for fp32 (no autocast)."""
        return _AUTOCAST_DTYPES.get(self.precision)

    @property
    def bf16_weights(self) -> bool:
        return self.training.weights is WeightsDtype.BF16

    @property
    def optimizer(self) -> OptimizerName:
        return self.training.optimizer

    @property
    def sharding(self) -> Sharding:
        return self.training.sharding

    @property
    def fsdp2(self) -> bool:
        """Sharded by FSDP2 (zero2, zero3, hybrid) when measured."""
        return self.sharding in FSDP2_SHARDINGS

    @property
    def eight_bit_adamw(self) -> EightBitAdamW:
        """The 8-bit AdamW measured for `optimizer: adamw8bit` with this sharding."""
        return eight_bit_adamw(self.sharding)

    @property
    def optimizer_class(self) -> tuple[str, dict[str, Any]]:
        """The measured optimizer as a script builds it: its class (importable as
        module.Class) and keyword arguments, but the learning rate."""
        if self.optimizer is OptimizerName.ADAMW_8BIT:
            return self.eight_bit_adamw.class_path, {}
        class_path, kwargs = _OPTIMIZER_CLASSES[self.optimizer]
        return class_path, dict(kwargs)

    @property
    def shard_group_size(self) -> int:
        """Ranks that shard among themselves: the hybrid group, else all of them."""
        return self.training.shard_group_size or self.world_size

    @property
    def tokens_per_sample(self) -> int | None:
        """Set for a token target: the packed sample length it was turned into samples with."""
        if self.training.target_global_tokens is None:
            return None
        return self.training.seq_len

    @property
    def lora(self) -> dict[str, Any] | None:
        return lora_config(self.training)


def lora_config(training: TrainingSpec) -> dict[str, Any] | None:
    """peft `LoraConfig` keyword arguments that rebuild the measured adapters on any model:
    "all-linear" leaves out the output head as the measurement did, whether or not peft knows
    the model's head (it knows only a transformers model's)."""
    if training.lora is None:
        return None
    lora = training.lora
    config: dict[str, Any] = {
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": lora.target_modules,
    }
    if lora.target_modules == "all-linear":
        config["exclude_modules"] = [OUTPUT_HEAD]
    if lora.modules_to_save:
        config["modules_to_save"] = list(lora.modules_to_save)
    return config


def lora_snippet(lora: dict[str, Any], model: str = "model", indent: str = "") -> str:
    """The two lines that add the measured adapters to `model`."""
    kwargs = ", ".join(f"{key}={value!r}" for key, value in lora.items())
    return (
        f"{indent}from peft import LoraConfig, get_peft_model\n"
        f"{indent}{model} = get_peft_model({model}, LoraConfig({kwargs}))\n"
    )
