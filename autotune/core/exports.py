"""Paste-ready settings for a recommendation, in each ecosystem's own key names.

Pure and torch-free: `build_exports` turns a `Recommendation` into plain dicts (Hugging Face
`TrainingArguments` kwargs, Axolotl YAML keys, DeepSpeed JSON keys, Lightning arguments) plus
the source of a complete plain-PyTorch training loop (filled in from the templates in
`autotune/templates/`, which it reads as text, never imports); `render_exports` turns those into
text.

Version rule for Hugging Face: transformers 5 renamed the `TrainingArguments` flag
`gradient_checkpointing` to `activation_checkpointing` (the old name still works in 5.x but
warns that v6 removes it). `hf` uses `activation_checkpointing` when the given transformers
version is 5 or later and `gradient_checkpointing` for 4.x. When the version is unknown (None)
it uses `gradient_checkpointing`, the one name every release before v6 accepts. The rendered
text states which rule applied.

Data parallel (world size > 1): the recommendation was measured for torch DDP with
`gradient_as_bucket_view=True` (`autotune.engine.training.data_parallel`). The PyTorch loop and
Lightning set it, the Hugging Face text shows where to set it (no `TrainingArguments` key does),
and the Axolotl and DeepSpeed texts say what their runs hold instead
(docs/design.md#data-parallel).
"""

from __future__ import annotations

import ast
import importlib.resources
import json
import re
import sys
from typing import Any

import yaml

from autotune.core.schemas import (
    Exports,
    OptimizerName,
    Precision,
    Recommendation,
    Sharding,
    TrainingSpec,
    WeightsDtype,
)

_ACTIVATION_CHECKPOINTING_SINCE_MAJOR = 5
# How DDP must be built for a rank to hold what was measured.
DDP_KWARGS = {"gradient_as_bucket_view": True}


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


def build_exports(
    rec: Recommendation,
    *,
    token_model: bool,
    transformers_version: str | None,
    training: TrainingSpec | None = None,
) -> Exports:
    """Settings that reproduce `rec` in Hugging Face, Axolotl, DeepSpeed, Lightning and plain
    PyTorch.

    Args:
        rec: The recommended configuration.
        token_model: True for language models: the PyTorch loop then normalises the loss by
            label tokens of the whole step, else by samples.
        transformers_version: The user's transformers version, or None when unknown; picks the
            Hugging Face checkpointing key (see the module docstring).
        training: the spec's training section (None: the defaults). A TF32 setting is
            exported as measured; a `target_global_tokens` makes every export state the tokens
            per step, and Axolotl pack its samples to `seq_len` (`sequence_len`,
            `sample_packing`), the full samples the target was turned into.

    Raises:
        ValueError: when `rec.global_batch` is not micro-batch * accumulation * world size.
    """
    training = training or TrainingSpec()
    tf32 = training.tf32
    b, accumulation, world = rec.micro_batch, rec.accumulation_steps, rec.world_size
    partial = rec.checkpointed_blocks if rec.checkpointing else None
    if b * accumulation * world != rec.global_batch:
        raise ValueError(
            f"inconsistent recommendation: {b} * {accumulation} * {world} != {rec.global_batch}"
        )
    hf: dict[str, Any] = {
        "per_device_train_batch_size": b,
        "gradient_accumulation_steps": accumulation,
        # Partial checkpointing is set on the model (the text says how): the Trainer's flag
        # would checkpoint every layer.
        hf_checkpointing_key(transformers_version): rec.checkpointing and partial is None,
    }
    axolotl: dict[str, Any] = {
        "micro_batch_size": b,
        "gradient_accumulation_steps": accumulation,
        "gradient_checkpointing": rec.checkpointing,
    }
    deepspeed = {
        "train_batch_size": rec.global_batch,
        "train_micro_batch_size_per_gpu": b,
        "gradient_accumulation_steps": accumulation,
    }
    # Lightning splits these over three objects: the Trainer owns accumulation, the datamodule
    # owns the batch size, and checkpointing has no Trainer flag, so it lives in the module.
    lightning: dict[str, Any] = {
        "trainer": {"accumulate_grad_batches": accumulation},
        "datamodule": {"batch_size": b},
        "module": {"gradient_checkpointing": rec.checkpointing},
    }
    sharding = training.sharding
    if sharding is not Sharding.NONE:
        _add_sharding(training, hf, axolotl, deepspeed, lightning, transformers_version)
    elif world > 1:
        # The Trainer's `strategy`: DDPStrategy passes these to DDP.
        lightning["ddp_strategy"] = dict(DDP_KWARGS)
    if tf32 is not None:
        hf["tf32"] = axolotl["tf32"] = tf32
        # Lightning has no Trainer flag: the module sets torch's matmul precision.
        lightning["module"]["float32_matmul_precision"] = "high" if tf32 else "highest"
    if training.precision is not Precision.FP32:
        hf[training.precision.value] = True  # TrainingArguments' bf16 / fp16 autocast flags
    if training.weights is WeightsDtype.BF16:
        # Axolotl's bf16 loads the weights in bf16 and trains them so: no fp32 master copy.
        axolotl["bf16"] = True
        lightning["trainer"]["precision"] = "bf16-true"
    elif training.precision is Precision.BF16:
        lightning["trainer"]["precision"] = "bf16-mixed"
    elif training.precision is Precision.FP16:
        lightning["trainer"]["precision"] = "16-mixed"
    if training.optimizer is OptimizerName.ADAMW_8BIT:
        # The same name in both: transformers' OptimizerNames.ADAMW_BNB.
        hf["optim"] = axolotl["optimizer"] = "adamw_bnb_8bit"
        lightning["module"]["optimizer"] = "bitsandbytes.optim.AdamW8bit"
    lora = _lora_config(training)
    if lora is not None:
        axolotl.update(_axolotl_lora(lora))
        lightning["module"]["lora"] = lora
    packed_seq_len = training.seq_len if training.target_global_tokens is not None else None
    if packed_seq_len is not None:
        axolotl["sequence_len"] = packed_seq_len
        axolotl["sample_packing"] = True
    if partial is not None:
        lightning["module"]["checkpointed_blocks"] = partial
    return Exports(
        checkpointed_blocks=partial,
        num_blocks=rec.num_blocks if partial is not None else None,
        tokens_per_sample=packed_seq_len,
        lora=lora,
        hf=hf,
        axolotl=axolotl,
        deepspeed=deepspeed,
        lightning=lightning,
        pytorch_loop=_pytorch_loop(
            rec,
            token_model=token_model,
            tokens_per_sample=packed_seq_len,
            setup=_setup_lines(training),
            lora=lora,
            training=training,
        ),
    )


# DeepSpeed's ZeRO stage for each sharding; hybrid is stage 3 within MiCS groups.
ZERO_STAGES = {Sharding.ZERO1: 1, Sharding.ZERO2: 2, Sharding.ZERO3: 3, Sharding.HYBRID: 3}
_FSDP1_STRATEGIES = {
    Sharding.ZERO2: "SHARD_GRAD_OP",
    Sharding.ZERO3: "FULL_SHARD",
    Sharding.HYBRID: "HYBRID_SHARD",
}


def _add_sharding(
    training: TrainingSpec,
    hf: dict[str, Any],
    axolotl: dict[str, Any],
    deepspeed: dict[str, Any],
    lightning: dict[str, Any],
    transformers_version: str | None,
) -> None:
    """Each ecosystem's settings for the measured sharding: ZeRO-1 through DeepSpeed (torch's
    ZeroRedundancyOptimizer was measured), ZeRO-2/3 and hybrid through FSDP (FSDP2 was)."""
    sharding = training.sharding
    zero: dict[str, Any] = {"stage": ZERO_STAGES[sharding]}
    if sharding is Sharding.HYBRID:
        zero["mics_shard_size"] = training.shard_group_size
    deepspeed["zero_optimization"] = zero
    if sharding is Sharding.ZERO1:
        hf["deepspeed"] = {**deepspeed, "zero_optimization": dict(zero)}
        axolotl["deepspeed"] = "deepspeed_configs/zero1.json"
        lightning["strategy"] = "deepspeed_stage_1"
        return
    fsdp2 = sharding is not Sharding.HYBRID  # FSDP2 through the Trainer: full or grad-op shard
    if transformers_version is not None and _transformers_major(transformers_version) >= 5:
        hf["fsdp"] = True
        hf["fsdp_config"] = (
            {"version": 2, "reshard_after_forward": sharding is Sharding.ZERO3}
            if fsdp2
            else {"version": 1, "reshard_after_forward": "hybrid_shard"}
        )
    else:
        hf["fsdp"] = f"{_FSDP1_STRATEGIES[sharding].lower()} auto_wrap"
    axolotl["fsdp_version"] = 2 if fsdp2 else 1
    axolotl["fsdp_config"] = {
        "reshard_after_forward": sharding is Sharding.ZERO3 if fsdp2 else "hybrid_shard",
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    }
    lightning["fsdp_strategy"] = {"sharding_strategy": _FSDP1_STRATEGIES[sharding]}


def _lora_config(training: TrainingSpec) -> dict[str, Any] | None:
    """peft `LoraConfig` keyword arguments for the spec's adapters."""
    if training.lora is None:
        return None
    lora = training.lora
    config: dict[str, Any] = {
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": lora.target_modules,
    }
    if lora.modules_to_save:
        config["modules_to_save"] = list(lora.modules_to_save)
    return config


def _axolotl_lora(lora: dict[str, Any]) -> dict[str, Any]:
    """Axolotl's adapter keys: `lora_target_linear` for every linear layer, else the names."""
    keys: dict[str, Any] = {
        "adapter": "lora",
        "lora_r": lora["r"],
        "lora_alpha": lora["lora_alpha"],
        "lora_dropout": lora["lora_dropout"],
    }
    if lora["target_modules"] == "all-linear":
        keys["lora_target_linear"] = True
    else:
        keys["lora_target_modules"] = list(lora["target_modules"])
    if "modules_to_save" in lora:
        keys["lora_modules_to_save"] = list(lora["modules_to_save"])
    return keys


def _lora_snippet(lora: dict[str, Any], indent: str = "") -> str:
    kwargs = ", ".join(f"{key}={value!r}" for key, value in lora.items())
    return (
        f"{indent}from peft import LoraConfig, get_peft_model\n"
        f"{indent}model = get_peft_model(model, LoraConfig({kwargs}))\n"
    )


def render_exports(exports: Exports) -> dict[str, str]:
    """Paste-ready text per target: `hf` and `lightning` as Python, `axolotl` as YAML,
    `deepspeed` as JSON, `pytorch_loop` as is; on several ranks also `data_parallel`, what the
    memory was measured with and what DeepSpeed (whose JSON cannot say it) does instead."""
    batch = _batch_comment(exports.deepspeed, exports.tokens_per_sample)
    ranks = _ranks(exports.deepspeed)
    zero = exports.deepspeed.get("zero_optimization")
    # DDP's notes are for unsharded ranks; sharded ones get their own.
    ddp_ranks = 1 if zero is not None else ranks
    texts = {
        "hf": _render_hf(
            exports.hf,
            batch,
            ddp_ranks,
            exports.tokens_per_sample,
            weights_bf16=exports.lightning["trainer"].get("precision") == "bf16-true",
            lora=exports.lora,
            partial=_partial_snippet(exports),
        ),
        "axolotl": f"# Axolotl config (merge into your YAML)\n{batch}"
        + _axolotl_ddp_comment(ddp_ranks)
        + _axolotl_partial_comment(exports)
        + yaml.safe_dump(exports.axolotl, sort_keys=False),
        "deepspeed": json.dumps(exports.deepspeed, indent=2) + "\n",
        "lightning": _render_lightning(exports.lightning, batch),
        "pytorch_loop": exports.pytorch_loop,
    }
    if zero is not None:
        texts["data_parallel"] = _sharding_note(ranks, zero)
    elif ranks > 1:
        texts["data_parallel"] = _data_parallel_note(ranks)
    return texts


def _sharding_note(ranks: int, zero: dict[str, Any]) -> str:
    stage = zero["stage"]
    group = zero.get("mics_shard_size")
    measured = (
        "torch DDP with ZeroRedundancyOptimizer (each rank the optimizer states of its share of\n"
        "# the parameters)"
        if stage == 1
        else "torch FSDP2 (fully_shard on each block, then the root"
        + (", without resharding after forward" if stage == 2 else "")
        + (f", sharded within groups of {group} ranks" if group else "")
        + ")"
    )
    return (
        f"# {ranks} ranks, ZeRO stage {stage}: memory per rank was measured with {measured};\n"
        "# gradients reduce-scattered after every micro-batch. DeepSpeed's own ZeRO keeps\n"
        "# flat buffers besides (reduce_bucket_size, allgather_bucket_size, stage 3's\n"
        "# prefetch_bucket_size) that were not measured: leave them room or lower them.\n"
    )


def _ranks(deepspeed: dict[str, Any]) -> int:
    """The rank count, from DeepSpeed's invariant train_batch_size == micro * accumulation *
    ranks."""
    micro = deepspeed["train_micro_batch_size_per_gpu"]
    accumulation = deepspeed["gradient_accumulation_steps"]
    ranks: int = deepspeed["train_batch_size"] // (micro * accumulation)
    return ranks


def _batch_comment(deepspeed: dict[str, Any], tokens_per_sample: int | None) -> str:
    """The batch arithmetic as a comment line (two for a token target)."""
    micro = deepspeed["train_micro_batch_size_per_gpu"]
    accumulation = deepspeed["gradient_accumulation_steps"]
    samples = deepspeed["train_batch_size"]
    tokens = (
        f"# = {samples * tokens_per_sample} tokens per optimizer step: packed samples of "
        f"{tokens_per_sample} tokens each\n"
        if tokens_per_sample is not None
        else ""
    )
    return (
        f"# global batch {samples} = {micro} per rank x {accumulation} "
        f"accumulation steps x {_ranks(deepspeed)} rank(s)\n{tokens}"
    )


def _axolotl_ddp_comment(ranks: int) -> str:
    if ranks == 1:
        return ""
    return (
        "# On several ranks the memory was measured for DDP with gradient_as_bucket_view=True,\n"
        "# which no Axolotl key sets: its runs keep DDP's default and hold one more copy of\n"
        "# the gradients (4 bytes per fp32 parameter) at the end of backward and in the\n"
        "# optimizer step. Leave that much free, e.g. a smaller micro_batch_size.\n"
    )


def _data_parallel_note(ranks: int) -> str:
    return (
        f"# {ranks} ranks: memory per rank was measured for torch DDP with\n"
        "# gradient_as_bucket_view=True (gradients live in DDP's all-reduce buckets), default\n"
        "# bucket sizes, buffers broadcast; the PyTorch loop and Lightning set it, the Hugging\n"
        "# Face text shows where. DDP's default (False) holds a second copy of the gradients.\n"
        "# DeepSpeed uses no torch DDP: without ZeRO it all-reduces after the last micro-batch's\n"
        "# backward through flat copies of the gradients (up to 5e8 elements each), a second\n"
        "# copy of the gradients at the end of backward that was not measured.\n"
    )


def _render_hf(
    hf: dict[str, Any],
    batch: str,
    ranks: int,
    tokens_per_sample: int | None,
    *,
    weights_bf16: bool,
    lora: dict[str, Any] | None,
    partial: str,
) -> str:
    if "activation_checkpointing" in hf:
        rule = "activation_checkpointing: the flag's name since transformers 5"
    else:
        rule = "gradient_checkpointing: the flag's name before transformers 5 (5.x: deprecated)"
    kwargs = "".join(f"    {key}={value!r},\n" for key, value in hf.items())
    # No TrainingArguments key reaches DDP's gradient_as_bucket_view; the Trainer's accelerator
    # reads its DDP kwargs only when train() wraps the model.
    ddp = (
        f"\n# {ranks} ranks: the memory was measured for DDP with gradient_as_bucket_view=True,\n"
        "# which no TrainingArguments key sets. Set it between building the Trainer and train():\n"
        "#     trainer = Trainer(model=model, args=args, ...)\n"
        "#     trainer.accelerator.ddp_handler.gradient_as_bucket_view = True\n"
        "# With accelerate alone: Accelerator(kwargs_handlers=[\n"
        "#     DistributedDataParallelKwargs(gradient_as_bucket_view=True)])\n"
        if ranks > 1
        else ""
    )
    # TrainingArguments has no sequence length; TRL's SFTConfig (a TrainingArguments) packs.
    weights = (
        "# bf16 weights, no fp32 master copy: load the model with\n"
        "#     AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16)\n"
        if weights_bf16
        else ""
    )
    packing = (
        "# The token target assumes packed samples: with TRL, SFTConfig(packing=True,\n"
        f"# max_length={tokens_per_sample}, ...) takes these arguments too.\n"
        if tokens_per_sample is not None
        else ""
    )
    return (
        f"# Hugging Face TrainingArguments; {rule}.\n{batch}{weights}{packing}"
        "from transformers import TrainingArguments\n\n"
        f"args = TrainingArguments(\n{kwargs}    # ... your other arguments\n)\n{ddp}"
        + (
            "\n# LoRA adapters as measured, on the model you give the Trainer:\n"
            + _lora_snippet(lora)
            if lora is not None
            else ""
        )
        + partial
    )


def _partial_snippet(exports: Exports) -> str:
    """The Hugging Face text's partial checkpointing: the Trainer's flag is off, the model's
    first k layers are checkpointed."""
    count = exports.checkpointed_blocks
    if count is None:
        return ""
    total = f" of {exports.num_blocks}" if exports.num_blocks is not None else ""
    return (
        f"\n# Partial activation checkpointing, as measured: the first {count}{total} layers.\n"
        "# (The Trainer's flag above would checkpoint every layer.) On the model:\n"
        + "".join(f"{line}\n" for line in _partial_lines(count, "model"))
    )


def _partial_lines(count: int, model: str) -> list[str]:
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


def _axolotl_partial_comment(exports: Exports) -> str:
    count = exports.checkpointed_blocks
    if count is None:
        return ""
    return (
        f"# Measured with the first {count} layers checkpointed; Axolotl checkpoints every\n"
        "# layer (gradient_checkpointing: true): the same memory or less, more recompute.\n"
    )


def _render_lightning(lightning: dict[str, Any], batch: str) -> str:
    trainer_kwargs = ", ".join(f"{k}={v!r}" for k, v in lightning["trainer"].items())
    datamodule_kwargs = ", ".join(f"{k}={v!r}" for k, v in lightning["datamodule"].items())
    strategy_import = ""
    if "ddp_strategy" in lightning:
        strategy_kwargs = ", ".join(f"{k}={v!r}" for k, v in lightning["ddp_strategy"].items())
        trainer_kwargs += f", strategy=DDPStrategy({strategy_kwargs})"
        strategy_import = "from lightning.pytorch.strategies import DDPStrategy\n"
    elif "fsdp_strategy" in lightning:
        strategy_kwargs = ", ".join(f"{k}={v!r}" for k, v in lightning["fsdp_strategy"].items())
        # Lightning wraps what auto_wrap_policy names: your model's block class.
        trainer_kwargs += (
            f", strategy=FSDPStrategy({strategy_kwargs}, auto_wrap_policy={{YourBlock}})"
        )
        strategy_import = "from lightning.pytorch.strategies import FSDPStrategy\n"
    elif "strategy" in lightning:
        trainer_kwargs += f", strategy={lightning['strategy']!r}"
    if "checkpointed_blocks" in lightning["module"]:
        count = lightning["module"]["checkpointed_blocks"]
        checkpointing = (
            f"# Activation checkpointing of the first {count} layers, as measured. Lightning has\n"
            "# no Trainer flag for it; in your LightningModule's configure_model, e.g. for a\n"
            "# Hugging Face model (self.model):\n"
            + "".join(f"#     {line}\n" for line in _partial_lines(count, "self.model"))
        )
    elif lightning["module"]["gradient_checkpointing"]:
        checkpointing = (
            "# Activation checkpointing: ON. Lightning has no Trainer flag for it; enable it in\n"
            "# your LightningModule, e.g. for a Hugging Face model:\n"
            "#     def configure_model(self):\n"
            "#         self.model.gradient_checkpointing_enable(\n"
            '#             gradient_checkpointing_kwargs={"use_reentrant": False}\n'
            "#         )\n"
        )
    else:
        checkpointing = "# Activation checkpointing: off (Lightning has no Trainer flag for it).\n"
    lora = lightning["module"].get("lora")
    if lora is not None:
        checkpointing += (
            "# LoRA adapters as measured: in your LightningModule's configure_model,\n"
            + _lora_snippet(lora, indent="#     ")
            .replace("model = ", "self.model = ", 1)
            .replace("(model,", "(self.model,", 1)
        )
    optimizer = lightning["module"].get("optimizer")
    if optimizer is not None:
        checkpointing += (
            f"# Optimizer as measured: return {optimizer}(self.parameters(), ...) from your\n"
            "# LightningModule's configure_optimizers.\n"
        )
    matmul_precision = lightning["module"].get("float32_matmul_precision")
    if matmul_precision is not None:
        # TF32 as measured: torch's switch, set before the Trainer runs.
        checkpointing += (
            f"import torch\ntorch.set_float32_matmul_precision({matmul_precision!r})\n"
        )
    return (
        "# Lightning: the Trainer owns accumulation; batch_size is per rank, in your datamodule.\n"
        f"{batch}import lightning as L\n{strategy_import}\n"
        f"trainer = L.Trainer({trainer_kwargs})\n"
        f"datamodule = YourDataModule({datamodule_kwargs})\n" + checkpointing
    )


# ---------------------------------------------------------------------------------------------
# The plain PyTorch loop: autotune/templates/train_loop.py with the task's source inlined
# (sample_task.py or token_task.py), a docstring that states the recommendation, and its numbers.

_TEMPLATES = "autotune.templates"
_TASK_MARKER = "# autotune-template: task\n"


def _template(name: str) -> str:
    return importlib.resources.files(_TEMPLATES).joinpath(name).read_text(encoding="utf-8")


def _split_module(source: str) -> tuple[list[str], str]:
    """A template's top-level imports (one statement per line, our own templates' imports left
    out) and its source after the last import."""
    tree = ast.parse(source)
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    statements = [
        ast.unparse(node)
        for node in imports
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith(_TEMPLATES))
    ]
    last_line = max(node.end_lineno or node.lineno for node in imports)
    rest = "".join(source.splitlines(keepends=True)[last_line:])
    return statements, rest.lstrip("\n")


def _import_block(statements: list[str]) -> str:
    """The statements in isort's order: standard library first, then the rest; plain imports
    before from-imports, each group by module."""

    def module(statement: str) -> str:
        return statement.split()[1]

    def key(statement: str) -> tuple[bool, str]:
        return statement.startswith("from "), module(statement).lower()

    unique = set(statements)
    stdlib = sorted(
        (s for s in unique if module(s).split(".")[0] in sys.stdlib_module_names), key=key
    )
    others = sorted(unique - set(stdlib), key=key)
    return "\n\n".join("\n".join(group) for group in (stdlib, others) if group) + "\n"


def _literal(value: dict[str, Any] | None) -> str:
    """A dict as the Python source of a literal, one key per line."""
    if value is None:
        return "None"
    items = "".join(f"    {key!r}: {item!r},\n" for key, item in value.items())
    return "{\n" + items.replace("'", '"') + "}"


def _set_constant(source: str, name: str, value: str) -> str:
    source, count = re.subn(
        rf"^{name}((?:: [^=]+)?) = .*$",
        lambda match: f"{name}{match.group(1)} = {value}",
        source,
        flags=re.MULTILINE,
    )
    if count != 1:
        raise AssertionError(f"template train_loop.py: {count} definitions of {name}")
    return source


_AUTOCAST_DTYPES = {Precision.BF16: "torch.bfloat16", Precision.FP16: "torch.float16"}


def _setup_lines(training: TrainingSpec) -> str:
    """What the loop's model and optimizer must be to hold what was measured, when it is not
    the demo's fp32 weights and torch AdamW."""
    lines = []
    if training.weights is WeightsDtype.BF16:
        lines.append(
            "Weights in bf16 with no fp32 master copy: model.to(torch.bfloat16) (Hugging Face:\n"
            "from_pretrained(..., dtype=torch.bfloat16)), computing under bf16 autocast.\n"
        )
    elif training.precision is not Precision.FP32:
        scaler = " with a GradScaler" if training.precision is Precision.FP16 else ""
        lines.append(
            "fp32 weights, forward under "
            f"torch.autocast(dtype={_AUTOCAST_DTYPES[training.precision]}){scaler}.\n"
        )
    if training.optimizer is OptimizerName.ADAMW_8BIT:
        lines.append(
            "Optimizer: bitsandbytes.optim.AdamW8bit(model.parameters(), ...) (8-bit states).\n"
        )
    return "".join(lines)


def _pytorch_loop(
    rec: Recommendation,
    *,
    token_model: bool,
    tokens_per_sample: int | None,
    setup: str,
    lora: dict[str, Any] | None,
    training: TrainingSpec,
) -> str:
    if token_model:
        normaliser = (
            "Loss: summed token cross-entropy of the whole optimizer step divided by the number\n"
            "of label tokens (labels != -100) in all of its micro-batches on all ranks, so\n"
            "every token weighs the same whatever the split and the padding. Batches are dicts:\n"
            '"labels" holds the input ids with -100 at padding (Hugging Face convention; the\n'
            "loop shifts them), every other key is passed to the model as a keyword."
        )
    else:
        normaliser = (
            "Loss: summed cross-entropy of the whole optimizer step divided by the number of\n"
            "samples in all of its micro-batches on all ranks. Batches are (inputs, labels)."
        )
    if rec.world_size > 1:
        ranks = (
            f"\nOn {rec.world_size} ranks: launch with torchrun (one process per GPU); the label\n"
            "count is all-reduced across ranks before the first backward, and the loss is\n"
            f"multiplied by {rec.world_size} to undo the averaging of gradients over ranks.\n"
            + (
                "DDP keeps gradients as views of its buckets (gradient_as_bucket_view=True), the\n"
                "memory the recommendation was measured with.\n"
                if training.sharding is Sharding.NONE
                else f"Sharding {training.sharding}, as measured: see SHARDING below.\n"
            )
        )
    else:
        ranks = ""
    header = (
        '"""Plain PyTorch training loop generated by autotune.\n\n'
        f"Micro-batch {rec.micro_batch} per rank, {rec.accumulation_steps} accumulation steps, "
        f"{rec.world_size} rank(s):\n"
        f"{rec.global_batch} samples per optimizer step; activation checkpointing "
        f"{'on' if rec.checkpointing else 'off'}.\n"
        + (
            f"{rec.global_batch * tokens_per_sample} tokens per optimizer step: samples packed "
            f"to {tokens_per_sample} tokens each.\n"
            if tokens_per_sample is not None
            else ""
        )
        + setup
        + f"{normaliser}\n{ranks}"
        'Run it as is for a demo on random data; replace DemoModel and the data with yours.\n"""\n'
    )
    loop_imports, loop = _split_module(_template("train_loop.py"))
    task_imports, task = _split_module(
        _template("token_task.py" if token_model else "sample_task.py")
    )
    if loop.count(_TASK_MARKER) != 1:
        raise AssertionError(f"template train_loop.py: no single {_TASK_MARKER!r}")
    loop = loop.replace(_TASK_MARKER, task)
    for name, value in (
        ("MICRO_BATCH", str(rec.micro_batch)),
        ("ACCUMULATION_STEPS", str(rec.accumulation_steps)),
        ("WORLD_SIZE", str(rec.world_size)),
        ("GLOBAL_BATCH", f"MICRO_BATCH * ACCUMULATION_STEPS * WORLD_SIZE  # {rec.global_batch}"),
        ("CHECKPOINTING", str(rec.checkpointing)),
        (
            "CHECKPOINT_BLOCKS",
            str(list(range(rec.checkpointed_blocks)))
            if rec.checkpointing and rec.checkpointed_blocks is not None
            else "None",
        ),
        ("LORA", _literal(lora)),
        ("SHARDING", repr(training.sharding.value).replace("'", '"')),
        ("SHARD_GROUP_SIZE", str(training.shard_group_size or 1)),
    ):
        loop = _set_constant(loop, name, value)
    return f"{header}\n{_import_block(loop_imports + task_imports)}\n{loop}"
