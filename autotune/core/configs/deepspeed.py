"""A DeepSpeed JSON config as a spec, with the model from `--model` and the sequence length
from `--seq-len` (DeepSpeed's config names neither). Key names are the export's
(`DEEPSPEED_KEYS`).

The ranks are `train_batch_size / (train_micro_batch_size_per_gpu x
gradient_accumulation_steps)` when all three are given, else the options' (`--world-size`, or
`--nodes` x `--gpus-per-node`), else one; `zero_optimization.stage` is the layout. `"auto"`
values (filled in by the Hugging Face Trainer) are refused: give the numbers, or the
TrainingArguments file.
"""

from __future__ import annotations

import json
import re
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
from autotune.core.configs.ranks import RankOptions, layout, rank_count
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
# Axolotl's shipped DeepSpeed configs are named by their stage (zero1.json ... zero3_bf16.json).
_AXOLOTL_NAME = re.compile(r"^zero([0-3])(?:_[\w]+)?\.json$")


def is_deepspeed(data: dict[str, Any]) -> bool:
    return any(_K[name] in data for name in ("global_batch", "micro_batch", "zero"))


def convert(
    data: dict[str, Any],
    path: Path,
    *,
    model: str | None,
    seq_len: int | None,
    options: RankOptions,
) -> Converted:
    """Raises:
    SpecError: no `--model` or `--seq-len`, "auto" values, ranks that disagree, or what
        autotune cannot model.
    """
    model, seq_len = named_elsewhere(model, seq_len, kind="DeepSpeed config")
    notes: list[str] = []
    micro = positive_int(data, _K["micro_batch"])
    accumulation = positive_int(data, _K["accumulation"], 1)
    said = None
    if data.get(_K["global_batch"]) is not None:
        global_batch = positive_int(data, _K["global_batch"])
        said, remainder = divmod(global_batch, micro * accumulation)
        if remainder or said < 1:
            raise refuse(
                _K["global_batch"],
                f"{global_batch} is not {_K['micro_batch']} {micro} x {_K['accumulation']} "
                f"{accumulation} x a number of ranks",
            )
    world_size = rank_count(options, said, key=_K["global_batch"], notes=notes)
    global_batch = micro * accumulation * world_size
    precision, weights = _precision(data, notes)
    file_layout = zero_sharding(data.get(_K["zero"]), key=_K["zero"], notes=notes)
    sharding = layout(options, file_layout, world_size, key=f"{_K['zero']}.stage", notes=notes)
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
        max_micro_batch=min(SEARCH_CAP, micro * accumulation),
        target_global_batch=global_batch,
        world_size=world_size,
        sharding=sharding,
        **options.topology(),
    )
    return Converted(
        spec=spec,
        format=ConfigFormat.DEEPSPEED,
        path=path,
        data=data,
        unmapped=tuple(notes),
        layout=file_layout,
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


def zero_sharding(zero: object, *, key: str, notes: list[str]) -> Sharding:
    """The layout of a `zero_optimization` section read at `key` (a file's own, or one
    that an Axolotl or TrainingArguments file points to); ranks are not its concern.

    Raises:
        SpecError: a stage that is not 0-3.
    """
    if not isinstance(zero, dict):
        return Sharding.NONE
    stage = zero.get("stage", 0)
    for offload in ("offload_optimizer", "offload_param"):
        target = zero.get(offload)
        if isinstance(target, dict) and target.get("device") not in (None, "none"):
            notes.append(f"{key}.{offload}: offloading not modelled (all on the GPU)")
    if stage == 0:
        return Sharding.NONE
    if stage not in _SHARDING:
        raise refuse(f"{key}.stage", f"{stage!r}: 0, 1, 2 or 3")
    return _SHARDING[stage]


def referenced_sharding(value: object, *, key: str, base: Path, notes: list[str]) -> Sharding:
    """The layout of the DeepSpeed config another file names under `key`: a dict, or a path
    read as the trainer reads it (from the working directory), else next to the file (`base`,
    its directory). A path that is not here is read by its name when it is one of Axolotl's
    (`deepspeed_configs/zero3_bf16.json`: stage 3), noted.

    Raises:
        SpecError: a path that is neither here nor named by its stage, or not a JSON object.
    """
    if isinstance(value, dict):
        return zero_sharding(value.get(_K["zero"]), key=f"{key}.{_K['zero']}", notes=notes)
    text = str(value)
    for candidate in (Path(text).expanduser(), base / text):
        if candidate.is_file():
            try:
                data = json.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as error:
                raise refuse(key, f"{text}: not a readable JSON file ({error})") from None
            if not isinstance(data, dict):
                raise refuse(key, f"{text}: not a DeepSpeed config (a JSON object)")
            section = data.get(_K["zero"])
            return zero_sharding(section, key=f"{key} {text}: {_K['zero']}", notes=notes)
    named = _AXOLOTL_NAME.search(Path(text).name)
    if named is None:
        raise refuse(key, f"{text}: no such file here, and its name says no ZeRO stage")
    stage = int(named.group(1))
    notes.append(f"{key}: {text} is not here; ZeRO stage {stage} read from its name")
    return zero_sharding({"stage": stage}, key=key, notes=notes)
