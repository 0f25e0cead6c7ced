"""A Hugging Face `TrainingArguments` JSON (as `TrainingArguments.to_json_string()` writes it;
the Trainer's `training_args.bin` is its pickle) as a spec, with the model from `--model` and
the sequence length from `--seq-len`: the arguments name neither.

Key names are the export's (`HF_KEYS`, `hf_checkpointing_key`). `bf16`/`fp16` are autocast
flags: the weights stay as the model was loaded (fp32 unless the script says otherwise).
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
)
from autotune.core.configs.model_source import model_source
from autotune.core.configs.optimizer_names import optimizer_named
from autotune.core.exports.hf import HF_KEYS
from autotune.core.schemas import Precision

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
    data: dict[str, Any], path: Path, *, model: str | None, seq_len: int | None
) -> Converted:
    """Raises:
    SpecError: no `--model` or `--seq-len`, or a setting autotune cannot model.
    """
    model, seq_len = named_elsewhere(model, seq_len, kind="TrainingArguments file")
    notes: list[str] = []
    micro = positive_int(data, _K["micro_batch"])
    accumulation = positive_int(data, _K["accumulation"], 1)
    notes.append(
        f"target global batch {micro * accumulation} = {_K['micro_batch']} {micro} x "
        f"{_K['accumulation']} {accumulation} x 1 rank (the file does not say how many)"
    )
    precision = Precision.FP32
    if data.get(_K["bf16"]):
        precision = Precision.BF16
    elif data.get(_K["fp16"]):
        precision = Precision.FP16
    optim = data.get(_K["optimizer"]) or DEFAULT_OPTIM
    optimizer, differs = optimizer_named(_K["optimizer"], optim)
    if differs:
        notes.append(f"{_K['optimizer']}: {optim} {differs}")
    for key in (_K["deepspeed"], _K["fsdp"]):
        if data.get(key):
            notes.append(f"{key}: shards across ranks; sized for one GPU, nothing sharded")
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
        target_global_batch=micro * accumulation,
    )
    return Converted(
        spec=spec, format=ConfigFormat.HF_ARGS, path=path, data=data, unmapped=tuple(notes)
    )
