"""A DeepSpeed JSON config as a spec, with the model from `--model` and the sequence length
from `--seq-len` (DeepSpeed's config names neither). Key names are the export's
(`DEEPSPEED_KEYS`).

The ranks are `train_batch_size / (train_micro_batch_size_per_gpu x
gradient_accumulation_steps)` when all three are given, else one. `"auto"` values (filled in by
the Hugging Face Trainer) are refused: give the numbers, or the TrainingArguments file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.core.configs.conversion import (
    SEARCH_CAP,
    ConfigFormat,
    Converted,
    build_spec,
    named_elsewhere,
    positive_int,
    refuse,
)
from autotune.core.configs.model_source import model_source
from autotune.core.exports.deepspeed import DEEPSPEED_KEYS
from autotune.core.exports.measured import ZERO_STAGES
from autotune.core.schemas import OptimizerName, Precision, Sharding, WeightsDtype

_K = DEEPSPEED_KEYS
# DeepSpeed's optimizer `type` (case-insensitive, as DeepSpeed reads it) -> the measured one.
_OPTIMIZERS = {
    "adamw": OptimizerName.ADAMW,
    "adam": OptimizerName.ADAMW,  # DeepSpeed's Adam decouples weight decay (adam_w_mode)
    "sgd": OptimizerName.SGD,
    "adafactor": OptimizerName.ADAFACTOR,
}
_AUTOCAST = {"bfloat16": Precision.BF16, "float16": Precision.FP16}
_SHARDING = {
    stage: sharding for sharding, stage in ZERO_STAGES.items() if sharding is not Sharding.HYBRID
}


def is_deepspeed(data: dict[str, Any]) -> bool:
    return any(_K[name] in data for name in ("global_batch", "micro_batch", "zero"))


def convert(
    data: dict[str, Any], path: Path, *, model: str | None, seq_len: int | None
) -> Converted:
    """Raises:
    SpecError: no `--model` or `--seq-len`, "auto" values, or what autotune cannot model.
    """
    model, seq_len = named_elsewhere(model, seq_len, kind="DeepSpeed config")
    notes: list[str] = []
    micro = positive_int(data, _K["micro_batch"])
    accumulation = positive_int(data, _K["accumulation"], 1)
    global_batch = positive_int(data, _K["global_batch"], micro * accumulation)
    world_size, remainder = divmod(global_batch, micro * accumulation)
    if remainder or world_size < 1:
        raise refuse(
            _K["global_batch"],
            f"{global_batch} is not {_K['micro_batch']} {micro} x {_K['accumulation']} "
            f"{accumulation} x a number of ranks",
        )
    precision, weights = _precision(data, notes)
    sharding = _sharding(data, world_size, notes)
    optimizer_section = data.get(_K["optimizer"])
    optimizer = OptimizerName.ADAMW
    if isinstance(optimizer_section, dict):
        kind = str(optimizer_section.get("type", "")).lower()
        if kind not in _OPTIMIZERS:
            raise refuse(
                f"{_K['optimizer']}.type",
                f"{optimizer_section.get('type')!r}: autotune models {', '.join(_OPTIMIZERS)}",
            )
        optimizer = _OPTIMIZERS[kind]
    else:
        notes.append(f"{_K['optimizer']}: none (a client optimizer); measured with AdamW")
    spec = build_spec(
        model_source(model, key="--model"),
        seq_len=seq_len,
        precision=precision,
        weights=weights,
        optimizer=optimizer,
        # A micro-batch above what one rank takes per step never serves the file's batch.
        max_micro_batch=min(SEARCH_CAP, global_batch // world_size),
        target_global_batch=global_batch,
        world_size=world_size,
        sharding=sharding,
    )
    return Converted(
        spec=spec, format=ConfigFormat.DEEPSPEED, path=path, data=data, unmapped=tuple(notes)
    )


def _enabled(section: object) -> bool:
    return isinstance(section, dict) and section.get("enabled") is True


def _precision(data: dict[str, Any], notes: list[str]) -> tuple[Precision, WeightsDtype]:
    autocast = data.get(_K["autocast"])
    if _enabled(autocast):
        assert isinstance(autocast, dict)
        dtype = autocast.get("dtype", "bfloat16")
        if dtype not in _AUTOCAST:
            raise refuse(f"{_K['autocast']}.dtype", f"{dtype!r}: bfloat16 or float16")
        return _AUTOCAST[dtype], WeightsDtype.FP32
    if _enabled(data.get(_K["bf16"])):
        notes.append(
            f"{_K['bf16']}: DeepSpeed's bf16 optimizer also keeps a master copy of the weights "
            "and gradients, which is not measured"
        )
        return Precision.BF16, WeightsDtype.BF16
    if _enabled(data.get(_K["fp16"])):
        notes.append(f"{_K['fp16']}: fp16 weights measured as fp32 weights under fp16 autocast")
        return Precision.FP16, WeightsDtype.FP32
    return Precision.FP32, WeightsDtype.FP32


def _sharding(data: dict[str, Any], world_size: int, notes: list[str]) -> Sharding:
    zero = data.get(_K["zero"])
    if not isinstance(zero, dict):
        return Sharding.NONE
    stage = zero.get("stage", 0)
    for offload in ("offload_optimizer", "offload_param"):
        target = zero.get(offload)
        if isinstance(target, dict) and target.get("device") not in (None, "none"):
            notes.append(f"{_K['zero']}.{offload}: offloading not modelled (all on the GPU)")
    if stage == 0:
        return Sharding.NONE
    if stage not in _SHARDING:
        raise refuse(f"{_K['zero']}.stage", f"{stage!r}: 0, 1, 2 or 3")
    if world_size < 2:
        notes.append(f"{_K['zero']}.stage: {stage} on one rank shards nothing")
        return Sharding.NONE
    return _SHARDING[stage]
