"""Paste-ready settings for a recommendation, in each consumer's own key names, that build the
run that was measured (docs/design.md#exports).

Pure and torch-free: `build_exports` turns a `Recommendation` and the spec's training section
into plain dicts (Hugging Face `TrainingArguments` kwargs, Axolotl YAML keys, DeepSpeed JSON
keys, Lightning arguments) plus the source of a complete plain-PyTorch training loop;
`render_exports` turns those into text. One module per consumer (`hf`, `axolotl`, `deepspeed`,
`lightning`, `pytorch_loop`), each with what it cannot express; what they share is in
`measured` (the measured run, the LoRA config) and `notes` (what every text says).
"""

from __future__ import annotations

import json

from autotune.core.exports.axolotl import axolotl_config, render_axolotl
from autotune.core.exports.deepspeed import deepspeed_config, deepspeed_notes
from autotune.core.exports.hf import hf_arguments, hf_checkpointing_key, render_hf
from autotune.core.exports.lightning import lightning_arguments, render_lightning
from autotune.core.exports.measured import ZERO_STAGES, MeasuredRun
from autotune.core.exports.notes import data_parallel_note
from autotune.core.exports.pytorch_loop import pytorch_loop
from autotune.core.schemas import Exports, Recommendation, TrainingSpec

__all__ = [
    "ZERO_STAGES",
    "build_exports",
    "hf_checkpointing_key",
    "render_exports",
]


def build_exports(
    rec: Recommendation,
    *,
    token_model: bool,
    transformers_version: str | None,
    training: TrainingSpec | None = None,
    device_allocator_conf: str | None = None,
) -> Exports:
    """Settings that reproduce `rec` in Hugging Face, Axolotl, DeepSpeed, Lightning and plain
    PyTorch: a pure function of its arguments, so that stored data rebuilds them.

    Args:
        rec: The recommended configuration.
        token_model: True for language models: the PyTorch loop then normalises the loss by
            label tokens of the whole step, else by samples.
        transformers_version: The user's transformers version, or None when unknown; picks the
            Hugging Face checkpointing key and FSDP version (`autotune.core.exports.hf`).
        training: the spec's training section (None: the defaults): precision, weights,
            optimizer, adapters, sharding (auto: the recommendation's layout) and TF32 as
            measured; a `target_global_tokens` makes
            every export state the tokens per step, and Axolotl pack its samples to `seq_len`.
        device_allocator_conf: the caching allocator's settings of the device the run was
            measured on (`DeviceInfo.allocator_conf`; None: torch's defaults), which every
            export sets unless the recommendation holds for its own (expandable segments).

    Raises:
        ValueError: when `rec.global_batch` is not micro-batch * accumulation * world size.
    """
    if training is not None:
        # sharding: auto exports the layout the tuner chose, as every consumer needs one.
        training = rec.layout_training(training)
    run = MeasuredRun.of(
        rec, training, token_model=token_model, device_allocator_conf=device_allocator_conf
    )
    return Exports(
        checkpointed_blocks=run.checkpointed_blocks,
        num_blocks=run.num_blocks,
        tokens_per_sample=run.tokens_per_sample,
        lora=run.lora,
        hf=hf_arguments(run, transformers_version),
        axolotl=axolotl_config(run),
        deepspeed=deepspeed_config(run),
        lightning=lightning_arguments(run),
        pytorch_loop=pytorch_loop(run),
        training=run.training,
        token_model=token_model,
        transformers_version=transformers_version,
        runs_out_below=list(run.runs_out_below),
        allocator_conf=run.allocator_conf,
    )


def _measured(exports: Exports) -> MeasuredRun:
    """The measured run, back from the exports' own numbers and training section."""
    deepspeed = exports.deepspeed
    micro = deepspeed["train_micro_batch_size_per_gpu"]
    accumulation = deepspeed["gradient_accumulation_steps"]
    global_batch = deepspeed["train_batch_size"]
    return MeasuredRun(
        micro_batch=micro,
        accumulation_steps=accumulation,
        world_size=global_batch // (micro * accumulation),
        global_batch=global_batch,
        checkpointing=bool(exports.lightning["module"]["gradient_checkpointing"]),
        checkpointed_blocks=exports.checkpointed_blocks,
        num_blocks=exports.num_blocks,
        training=exports.training,
        token_model=exports.token_model,
        runs_out_below=tuple(exports.runs_out_below),
        allocator_conf=exports.allocator_conf,
    )


def render_exports(exports: Exports) -> dict[str, str]:
    """Paste-ready text per target: `hf` and `lightning` as Python, `axolotl` as YAML,
    `deepspeed` as JSON, `pytorch_loop` as is; `deepspeed_notes`, what the JSON cannot say
    (the notes every text carries among them); on several ranks also `data_parallel`, what the
    memory was measured with and what DeepSpeed does instead."""
    run = _measured(exports)
    texts = {
        "hf": render_hf(run, exports.hf),
        "axolotl": render_axolotl(run, exports.axolotl),
        "deepspeed": json.dumps(exports.deepspeed, indent=2) + "\n",
        "lightning": render_lightning(run, exports.lightning),
        "pytorch_loop": exports.pytorch_loop,
    }
    texts["deepspeed_notes"] = deepspeed_notes(run)
    if run.world_size > 1:
        texts["data_parallel"] = data_parallel_note(run)
    return texts
