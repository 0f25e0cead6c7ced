"""A Hugging Face `TrainingArguments` JSON (as `TrainingArguments.to_json_string()` writes it;
the Trainer's `training_args.bin` is its pickle) as a spec, with the model from `--model` and
the sequence length from `--seq-len`: the arguments name neither.

Key names are the export's (`HF_KEYS`, `hf_checkpointing_key`). `bf16`/`fp16` are autocast
flags: the weights stay as the model was loaded (fp32 unless the script says otherwise). The
layout is `deepspeed` (a config or its path: its zero stage) or `fsdp` with `fsdp_config`
(`autotune.core.configs.fsdp`); the ranks come from `--world-size` or `--nodes` x
`--gpus-per-node` (the launcher sets them, not the arguments).
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
from autotune.core.configs.deepspeed import referenced_sharding
from autotune.core.configs.fsdp import fsdp_sharding
from autotune.core.configs.model_source import model_source
from autotune.core.configs.optimizer_names import optimizer_named
from autotune.core.configs.ranks import (
    LAYOUT,
    WORLD_SIZE_OPTION,
    RankOptions,
    layout,
    rank_count,
)
from autotune.core.exports.hf import HF_KEYS
from autotune.core.schemas import Precision, Sharding

_K = HF_KEYS
# TrainingArguments' own default for `optim` (transformers 5).
DEFAULT_OPTIM = "adamw_torch_fused"
# Settings that change what a step holds which autotune does not model, when set.
_NOT_MODELLED = (
    "torch_compile",
    "use_liger_kernel",
    "optim_target_modules",
    "torch_empty_cache_steps",
    "gradient_checkpointing_kwargs",
)


def is_hf_arguments(data: dict[str, Any]) -> bool:
    return _K["micro_batch"] in data


def convert(
    data: dict[str, Any],
    path: Path,
    *,
    model: str | None,
    seq_len: int | None,
    options: RankOptions,
) -> Converted:
    """Raises:
    SpecError: no `--model` or `--seq-len`, or a setting autotune cannot model.
    """
    model, seq_len = named_elsewhere(model, seq_len, kind="TrainingArguments file")
    notes: list[str] = []
    micro = positive_int(data, _K["micro_batch"])
    accumulation = positive_int(data, _K["accumulation"], 1)
    world_size = rank_count(options, None, key=WORLD_SIZE_OPTION, notes=notes)
    precision = Precision.FP32
    if data.get(_K["bf16"]):
        precision = Precision.BF16
    elif data.get(_K["fp16"]):
        precision = Precision.FP16
    optim = data.get(_K["optimizer"]) or DEFAULT_OPTIM
    optimizer, differs = optimizer_named(_K["optimizer"], optim)
    if differs:
        notes.append(f"{_K['optimizer']}: {optim} {differs}")
    file_layout = _layout(data, path, notes)
    layout_key = LAYOUT
    if data.get(_K["deepspeed"]):
        layout_key = _K["deepspeed"]
    elif data.get(_K["fsdp"]):
        layout_key = _K["fsdp"]
    sharding = layout(options, file_layout, world_size, key=layout_key, notes=notes)
    notes += [f"{key}: not modelled" for key in _NOT_MODELLED if data.get(key)]
    tf32 = data.get(_K["tf32"])
    spec = build_spec(
        model_source(model, key="--model"),
        seq_len=seq_len,
        precision=precision,
        tf32=tf32 if isinstance(tf32, bool) else None,
        optimizer=optimizer,
        # A micro-batch above what one rank takes per step never serves the file's batch.
        max_micro_batch=min(SEARCH_CAP, micro * accumulation),
        target_global_batch=micro * accumulation * world_size,
        world_size=world_size,
        sharding=sharding,
        **options.topology(),
    )
    return Converted(
        spec=spec,
        format=ConfigFormat.HF_ARGS,
        path=path,
        data=data,
        unmapped=tuple(notes),
        layout=file_layout,
    )


def _layout(data: dict[str, Any], path: Path, notes: list[str]) -> Sharding:
    """The sharding the arguments set up.

    Raises:
        SpecError: both DeepSpeed and FSDP, or a layout that is not modelled.
    """
    deepspeed, fsdp = data.get(_K["deepspeed"]), data.get(_K["fsdp"])
    if deepspeed and fsdp:
        raise refuse(_K["fsdp"], f"set with {_K['deepspeed']} as well: the Trainer takes one")
    if deepspeed:
        return referenced_sharding(deepspeed, key=_K["deepspeed"], base=path.parent, notes=notes)
    if not fsdp:
        return Sharding.NONE
    # A string ("full_shard auto_wrap"), its words as a list (how 4.x saves it), or True (5.x).
    words = fsdp.split() if isinstance(fsdp, str) else fsdp if isinstance(fsdp, list) else []
    config = data.get(_K["fsdp_config"])
    return fsdp_sharding(
        [str(word) for word in words],
        config if isinstance(config, dict) else {},
        key=_K["fsdp"],
        notes=notes,
        # fsdp: True is transformers 5's, whose default is FSDP2; the words are 4.x's (FSDP1).
        default_version=2 if fsdp is True else 1,
    )
