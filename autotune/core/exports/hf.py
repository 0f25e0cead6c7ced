"""Hugging Face `TrainingArguments` for the measured run, and its paste-ready text.

Version rule: transformers 5 renamed the flag `gradient_checkpointing` to
`activation_checkpointing` (the old name still works in 5.x but warns that v6 removes it). The
export uses `activation_checkpointing` when the given transformers version is 5 or later and
`gradient_checkpointing` for 4.x; when the version is unknown (None), `gradient_checkpointing`,
the one name every release before v6 accepts. Sharding follows the same versions: FSDP2
(`fsdp_config={"version": 2, ...}`, hybrid groups through accelerate's `ParallelismConfig`) from
transformers 5, FSDP1's `fsdp` strings before it (whose `hybrid_shard` shards within a node, not
within the measured groups: the text says so). The rendered text states which rule applied.

Data parallel: the recommendation was measured for torch DDP with `gradient_as_bucket_view=True`,
which no `TrainingArguments` key sets: the text shows where to set it.

FSDP2's mixed precision: fp32 weights under autocast were measured with parameters gathered in
the autocast dtype and gradients reduced in fp32 (`MixedPrecisionPolicy(param_dtype,
reduce_dtype=float32)`). No `fsdp_config` key reaches accelerate's `mixed_precision_policy`
(transformers 5's `_process_fsdp_args`), and with `bf16`/`fp16` accelerate's own default reduces
in the 16-bit dtype too (its plugin's `set_mixed_precision`); the Trainer builds its FSDP plugin
from `args.fsdp_plugin_args`, so the text sets the measured policy there.
"""

from __future__ import annotations

import re
from typing import Any

from autotune.core.exports.deepspeed import deepspeed_config
from autotune.core.exports.measured import MeasuredRun, lora_snippet
from autotune.core.exports.notes import allocator_lines, comment, shared_notes
from autotune.core.parallel.layouts import gathers_in_16_bits
from autotune.core.schemas import OptimizerName, Precision, Sharding

# Our name for each setting -> its `TrainingArguments` field (the checkpointing flag's name
# depends on the version: `hf_checkpointing_key`).
HF_KEYS = {
    "micro_batch": "per_device_train_batch_size",
    "accumulation": "gradient_accumulation_steps",
    "bf16": "bf16",  # autocast flags: the weights stay as the model was loaded
    "fp16": "fp16",
    "tf32": "tf32",
    "optimizer": "optim",
    "optimizer_args": "optim_args",
    "deepspeed": "deepspeed",
    "fsdp": "fsdp",
    "fsdp_config": "fsdp_config",
}
_K = HF_KEYS
_ACTIVATION_CHECKPOINTING_SINCE_MAJOR = 5
_FSDP2_SINCE_MAJOR = 5
# TrainingArguments' `optim` for each measured optimizer, and its `optim_args`.
OPTIM = {
    OptimizerName.ADAMW: ("adamw_torch", None),
    OptimizerName.SGD: ("sgd", "momentum=0.9"),
}
# The others go to the Trainer as a class (`MeasuredRun.optimizer_class`): optim="adafactor" is
# transformers' own Adafactor, and optim="adamw_bnb_8bit" keeps the embeddings' states in 32 bits
# (8 bytes per element where 2 were measured: gigabytes for a large vocabulary).
_FSDP1_STRATEGIES = {
    Sharding.ZERO2: "shard_grad_op",
    Sharding.ZERO3: "full_shard",
    Sharding.HYBRID: "hybrid_shard",
}


def _transformers_major(version: str) -> int:
    match = re.match(r"\s*v?(\d+)\.", version)
    if match is None:
        raise ValueError(f"not a transformers version: {version!r}")
    return int(match.group(1))


def hf_checkpointing_key(transformers_version: str | None) -> str:
    """The `TrainingArguments` flag that turns on activation checkpointing for this version."""
    if transformers_version is None:
        return "gradient_checkpointing"
    if _transformers_major(transformers_version) >= _ACTIVATION_CHECKPOINTING_SINCE_MAJOR:
        return "activation_checkpointing"
    return "gradient_checkpointing"


def _fsdp2(transformers_version: str | None) -> bool:
    return (
        transformers_version is not None
        and _transformers_major(transformers_version) >= _FSDP2_SINCE_MAJOR
    )


def hf_arguments(run: MeasuredRun, transformers_version: str | None) -> dict[str, Any]:
    """`TrainingArguments` keyword arguments (`parallelism_config` as accelerate's
    `ParallelismConfig` keyword arguments)."""
    hf: dict[str, Any] = {
        _K["micro_batch"]: run.micro_batch,
        _K["accumulation"]: run.accumulation_steps,
        # Partial checkpointing is set on the model (the text says how): the Trainer's flag
        # would checkpoint every layer.
        hf_checkpointing_key(transformers_version): run.checkpointing
        and run.checkpointed_blocks is None,
    }
    training = run.training
    if training.tf32 is not None:
        hf[_K["tf32"]] = training.tf32
    if training.precision is not Precision.FP32:
        hf[_K[training.precision.value]] = True  # TrainingArguments' bf16 / fp16 autocast flags
    if run.optimizer in OPTIM:
        optim, optim_args = OPTIM[run.optimizer]
        hf[_K["optimizer"]] = optim
        if optim_args is not None:
            hf[_K["optimizer_args"]] = optim_args
    elif run.optimizer is OptimizerName.ADAMW_8BIT and run.fsdp2:
        # transformers builds torchao's AdamW8bit itself, with no 32-bit embedding states.
        hf[_K["optimizer"]] = run.eight_bit_adamw.hf_optim
    if run.sharding is Sharding.ZERO1:
        hf[_K["deepspeed"]] = deepspeed_config(run)
    elif run.fsdp2:
        hf.update(_fsdp_arguments(run, transformers_version))
    return hf


def _fsdp_arguments(run: MeasuredRun, transformers_version: str | None) -> dict[str, Any]:
    if not _fsdp2(transformers_version):
        return {"fsdp": f"{_FSDP1_STRATEGIES[run.sharding]} auto_wrap"}
    arguments: dict[str, Any] = {
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            "reshard_after_forward": run.sharding is not Sharding.ZERO2,
        },
    }
    if run.sharding is Sharding.HYBRID:
        arguments["parallelism_config"] = {
            "dp_replicate_size": run.world_size // run.shard_group_size,
            "dp_shard_size": run.shard_group_size,
        }
    return arguments


def render_hf(run: MeasuredRun, hf: dict[str, Any]) -> str:
    if "activation_checkpointing" in hf:
        rule = "activation_checkpointing: the flag's name since transformers 5"
    else:
        rule = "gradient_checkpointing: the flag's name before transformers 5 (5.x: deprecated)"
    kwargs = "".join(
        f"    {key}=ParallelismConfig(**{value!r}),\n"
        if key == "parallelism_config"
        else f"    {key}={value!r},\n"
        for key, value in hf.items()
    )
    imports = "from transformers import TrainingArguments\n"
    if "parallelism_config" in hf:
        imports = "from accelerate.parallelism_config import ParallelismConfig\n" + imports
    return (
        f"# Hugging Face TrainingArguments; {rule}.\n"
        + comment(shared_notes(run))
        + _packing_lines(run)
        + _sharding_lines(run, hf)
        + allocator_lines(run)
        + f"{imports}\nargs = TrainingArguments(\n{kwargs}    # ... your other arguments\n)\n"
        + _mixed_precision_lines(run, hf)
        + _ddp_lines(run)
        + _optimizer_lines(run)
        + _weights_lines(run)
        + (
            "\n# LoRA adapters as measured, on the model you give the Trainer:\n"
            + lora_snippet(run.lora)
            if run.lora is not None
            else ""
        )
        + _partial_snippet(run)
    )


def _weights_lines(run: MeasuredRun) -> str:
    if not run.bf16_weights:
        return ""
    return (
        "\n# bf16 weights, no fp32 master copy (or load the model so:\n"
        "# AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16))"
        + (", before the adapters: peft keeps them fp32, as measured" if run.lora else "")
        + ":\nimport torch\n\nmodel = model.to(torch.bfloat16)\n"
    )


def _packing_lines(run: MeasuredRun) -> str:
    # TrainingArguments has no sequence length; TRL's SFTConfig (a TrainingArguments) packs.
    if run.tokens_per_sample is None:
        return ""
    return (
        "# The token target assumes packed samples: with TRL, SFTConfig(packing=True,\n"
        f"# max_length={run.tokens_per_sample}, ...) takes these arguments too.\n"
    )


def _sharding_lines(run: MeasuredRun, hf: dict[str, Any]) -> str:
    if run.sharding is Sharding.ZERO1:
        return (
            "# ZeRO-1 through DeepSpeed (FSDP has no ZeRO-1); the measured run was torch DDP\n"
            "# with ZeroRedundancyOptimizer. The dict is the DeepSpeed export.\n"
        )
    if not run.fsdp2:
        return ""
    group = run.shard_group_size
    if hf.get("fsdp") is True:
        within = (
            f", sharded within groups of {group} ranks (ParallelismConfig)"
            if run.sharding is Sharding.HYBRID
            else ""
        )
        return f"# FSDP2, as measured{within}; transformers 5 or later.\n"
    hybrid = (
        "\n# FSDP1's hybrid_shard shards within a node, not within the measured groups of "
        f"{group}\n# ranks: the same only with {group} GPUs per node."
        if run.sharding is Sharding.HYBRID
        else ""
    )
    return (
        "# FSDP1 (the fsdp string): transformers before 5 has no FSDP2 here; FSDP2 was measured."
        f"{hybrid}\n"
    )


def _mixed_precision_lines(run: MeasuredRun, hf: dict[str, Any]) -> str:
    """FSDP2's measured policy, set where the Trainer builds its FSDP plugin from (see the
    module docstring); under FSDP1's strings, what accelerate does instead."""
    if not run.fsdp2 or not gathers_in_16_bits(run.training):
        return ""
    dtype = run.autocast_dtype
    if hf.get("fsdp") is not True:
        return (
            f"\n# FSDP1 under {run.precision.value}: accelerate gathers and reduces in {dtype}; "
            "measured: FSDP2 reducing\n# gradients in fp32.\n"
        )
    return (
        f"\n# FSDP2's mixed precision as measured: parameters gathered in {dtype}, gradients "
        "reduced in\n# fp32. No fsdp_config key sets it (accelerate's default would reduce in "
        f"{dtype}); the Trainer\n# builds its FSDP plugin from args.fsdp_plugin_args:\n"
        "import torch\nfrom torch.distributed.fsdp import MixedPrecisionPolicy\n\n"
        'args.fsdp_plugin_args["mixed_precision_policy"] = MixedPrecisionPolicy(\n'
        f"    param_dtype=torch.{dtype}, reduce_dtype=torch.float32\n)\n"
    )


def _ddp_lines(run: MeasuredRun) -> str:
    # No TrainingArguments key reaches DDP's gradient_as_bucket_view; the Trainer's accelerator
    # reads its DDP kwargs only when train() wraps the model.
    if run.world_size == 1 or run.sharding is not Sharding.NONE:
        return ""
    return (
        f"\n# {run.world_size} ranks: the memory was measured for DDP with "
        "gradient_as_bucket_view=True,\n"
        "# which no TrainingArguments key sets. Set it between building the Trainer and train():\n"
        "#     trainer = Trainer(model=model, args=args, ...)\n"
        "#     trainer.accelerator.ddp_handler.gradient_as_bucket_view = True\n"
        "# With accelerate alone: Accelerator(kwargs_handlers=[\n"
        "#     DistributedDataParallelKwargs(gradient_as_bucket_view=True)])\n"
    )


def _optimizer_lines(run: MeasuredRun) -> str:
    if run.optimizer in OPTIM:
        return ""
    if run.optimizer is OptimizerName.ADAMW_8BIT and run.fsdp2:
        return (
            "\n# optim='adamw_torch_8bit' builds torchao's AdamW8bit, measured for FSDP2 shards\n"
            "# (bitsandbytes' does not support them): pip install torchao.\n"
        )
    name, kwargs = run.optimizer_class
    module = name.split(".")[0]  # the package: `import torch` makes torch.optim.Adafactor
    why = (
        "optim='adamw_bnb_8bit' would keep the embeddings' states in 32 bits"
        if run.optimizer is OptimizerName.ADAMW_8BIT
        else "optim='adafactor' is transformers' own Adafactor"
    )
    return (
        f"\n# The measured optimizer, {name} ({why}):\n"
        "#     Trainer(model=model, args=args,\n"
        "#             optimizer_cls_and_kwargs=optimizer_cls_and_kwargs, ...)\n"
        f"import {module}\n\noptimizer_cls_and_kwargs = ({name}, {kwargs!r})\n"
    )


def _partial_snippet(run: MeasuredRun) -> str:
    """Partial checkpointing: the Trainer's flag is off, the model's first k layers are
    checkpointed."""
    count = run.checkpointed_blocks
    if count is None:
        return ""
    total = f" of {run.num_blocks}" if run.num_blocks is not None else ""
    return (
        f"\n# Partial activation checkpointing, as measured: the first {count}{total} layers.\n"
        "# (The Trainer's flag above would checkpoint every layer.) On the model:\n"
        + "".join(f"{line}\n" for line in partial_lines(count, "model"))
    )


def partial_lines(count: int, model: str) -> list[str]:
    """How to checkpoint the first `count` layers of a Hugging Face model: enable checkpointing,
    then clear the flag of every later `GradientCheckpointingLayer` (transformers 4.52 on)."""
    return [
        f"{model}.gradient_checkpointing_enable(",
        '    gradient_checkpointing_kwargs={"use_reentrant": False}',
        ")",
        "from transformers.modeling_layers import GradientCheckpointingLayer",
        f"layers = [m for m in {model}.modules() if isinstance(m, GradientCheckpointingLayer)]",
        f"for layer in layers[{count}:]:",
        "    layer.gradient_checkpointing = False",
    ]
