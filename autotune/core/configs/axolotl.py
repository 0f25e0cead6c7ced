"""An Axolotl YAML config as a spec. Key names are the export's (`AXOLOTL_KEYS`, read from
Axolotl's schema); the defaults are that schema's where the file leaves a key out.

Mapped: `base_model` (or `--model`), `sequence_len`, `sample_packing`, `micro_batch_size` x
`gradient_accumulation_steps` x the ranks as the target global batch, `adapter: lora` with
`lora_*`, `bf16`/`fp16`/`tf32`, `optimizer`, `gradient_checkpointing` (both modes are probed),
and the layout: `deepspeed` (a config or its path: its zero stage) or `fsdp`/`fsdp_config`
(`autotune.core.configs.fsdp`), hybrid when `dp_shard_size` is less than the ranks. The ranks:
`dp_shard_size` x `dp_replicate_size`, or Ray's `ray_num_workers`, or the options
(`--world-size`, `--nodes` x `--gpus-per-node`), else one.
Refused: a quantized base (`adapter: qlora`, `load_in_4bit`, `load_in_8bit`): autotune builds
the base in bf16 or fp32 and has no model of 4- or 8-bit weights; tensor, context and expert
parallelism, which split a rank's work in ways autotune does not measure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.core.configs.conversion import (
    SEARCH_CAP,
    ConfigFormat,
    Converted,
    build_spec,
    positive_int,
    refuse,
)
from autotune.core.configs.deepspeed import referenced_sharding
from autotune.core.configs.fsdp import fsdp_sharding
from autotune.core.configs.model_source import model_source
from autotune.core.configs.optimizer_names import optimizer_named
from autotune.core.configs.ranks import LAYOUT, RankOptions, layout, rank_count
from autotune.core.exports.axolotl import AXOLOTL_KEYS
from autotune.core.schemas import LoraSpec, Precision, Sharding, WeightsDtype

_K = AXOLOTL_KEYS
# Axolotl's schema defaults (utils/schemas/config.py, training.py) for keys a file leaves out.
DEFAULT_SEQUENCE_LEN = 512
DEFAULT_OPTIMIZER = "adamw_torch_fused"
# peft's LoraConfig defaults, which Axolotl passes on when lora_r / lora_alpha are unset.
DEFAULT_LORA_R = 8
DEFAULT_LORA_ALPHA = 8
BASE_MODEL = "base_model"
FSDP = "fsdp"  # FSDP1's strategy words (deprecated: fsdp_config says it)
RAY_WORKERS = "ray_num_workers"  # with use_ray: one GPU per worker
_MODEL_PARALLEL = (
    "tensor_parallel_size",
    "context_parallel_size",
    "sequence_parallel_degree",  # context_parallel_size's old name
    "expert_parallel_size",
)
# Keys that do not change what a training step holds in memory.
_NOT_MEMORY = frozenset(
    {
        "base_model_config",
        "model_type",
        "tokenizer_type",
        "tokenizer_config",
        "strict",
        "trust_remote_code",
        "datasets",
        "test_datasets",
        "dataset_prepared_path",
        "val_set_size",
        "output_dir",
        "hub_model_id",
        "hub_strategy",
        "chat_template",
        "eval_sample_packing",
        "num_epochs",
        "max_steps",
        "lr_scheduler",
        "learning_rate",
        "warmup_ratio",
        "warmup_steps",
        "weight_decay",
        "max_grad_norm",
        "logging_steps",
        "evals_per_epoch",
        "eval_steps",
        "saves_per_epoch",
        "save_steps",
        "save_total_limit",
        "save_first_step",
        "resume_from_checkpoint",
        "auto_resume_from_checkpoints",
        "special_tokens",
        "tokens",
        "loss_watchdog_threshold",
        "loss_watchdog_patience",
        "lora_model_dir",
        "early_stopping_patience",
        "seed",
        "train_on_inputs",
        "group_by_length",
        "dataset_processes",
        "shuffle_merged_datasets",
        "load_best_model_at_end",
        "gradient_checkpointing_kwargs",
        "eval_batch_size",
        "pad_to_sequence_len",
    }
)
_QUANTIZED_BASE = ("load_in_4bit", "load_in_8bit")


def is_axolotl(data: dict[str, Any]) -> bool:
    return BASE_MODEL in data or _K["micro_batch"] in data


def convert(
    data: dict[str, Any], path: Path, *, model: str | None, options: RankOptions
) -> Converted:
    """Raises:
    SpecError: a setting autotune cannot model, or a value Axolotl would not take.
    """
    notes: list[str] = []
    used = {BASE_MODEL}
    adapter = data.get(_K["adapter"])
    if adapter == "qlora":
        raise refuse(
            _K["adapter"],
            "qlora trains adapters on a 4-bit base, which autotune does not model (it builds "
            "the base in bf16 or fp32); size the run with adapter: lora",
        )
    for key in _QUANTIZED_BASE:
        if data.get(key):
            raise refuse(key, "a quantized base, which autotune does not model")
        used.add(key)
    if model is None and not isinstance(data.get(BASE_MODEL), str):
        raise refuse(BASE_MODEL, "missing: a hub id or a local model directory is needed")
    source = (
        model_source(model, key="--model")
        if model
        else model_source(data[BASE_MODEL], key=BASE_MODEL)
    )
    if model is not None:
        notes.append(f"{BASE_MODEL}: replaced by --model {model}")

    seq_len = positive_int(data, _K["sequence_len"], DEFAULT_SEQUENCE_LEN)
    if not data.get(_K["sample_packing"]):
        notes.append(
            f"{_K['sample_packing']}: off; every sample sized at {_K['sequence_len']} "
            f"{seq_len} (the longest it may be)"
        )
    micro = positive_int(data, _K["micro_batch"], 1)
    accumulation = positive_int(data, _K["accumulation"], 1)
    used |= {_K["sequence_len"], _K["sample_packing"], _K["micro_batch"], _K["accumulation"]}
    world_size, shard_group = _ranks(data, options, notes, used)

    precision, weights = _precision(data, notes)
    used |= {_K["bf16"], _K["fp16"], _K["tf32"], "bfloat16", "float16"}
    optimizer_name = data.get(_K["optimizer"]) or DEFAULT_OPTIMIZER
    optimizer, differs = optimizer_named(_K["optimizer"], optimizer_name)
    if differs:
        notes.append(f"{_K['optimizer']}: {optimizer_name} {differs}")
    used |= {_K["optimizer"], _K["optimizer_args"]}

    lora = _lora(data, adapter, notes, used)
    checkpointing = data.get(_K["checkpointing"])
    if checkpointing not in (None, True, False):
        notes.append(
            f"{_K['checkpointing']}: {checkpointing!r} measured as checkpointing in GPU memory"
        )
    used.add(_K["checkpointing"])
    file_layout = _layout(data, path, shard_group, notes)
    used |= {_K["deepspeed"], FSDP, _K["fsdp_config"], _K["fsdp_version"]}
    layout_key = LAYOUT
    if data.get(_K["deepspeed"]):
        layout_key = _K["deepspeed"]
    elif file_layout is not Sharding.NONE:
        layout_key = _K["fsdp_config"]
    sharding = layout(
        options,
        file_layout,
        world_size,
        key=layout_key,
        notes=notes,
        grouped=shard_group is not None,
    )

    notes += [
        f"{key}: not modelled"
        for key, value in data.items()
        if key not in used
        and key not in _NOT_MEMORY
        and value is not None
        and not key.startswith(("wandb_", "mlflow_", "comet_"))
    ]
    spec = build_spec(
        source,
        seq_len=seq_len,
        precision=precision,
        weights=weights,
        tf32=data.get(_K["tf32"]) if isinstance(data.get(_K["tf32"]), bool) else None,
        optimizer=optimizer,
        lora=lora,
        # A micro-batch above what one rank takes per step never serves the file's batch.
        max_micro_batch=min(SEARCH_CAP, micro * accumulation),
        target_global_batch=micro * accumulation * world_size,
        world_size=world_size,
        sharding=sharding,
        shard_group_size=shard_group if sharding is Sharding.HYBRID else None,
        **options.topology(),
    )
    return Converted(
        spec=spec,
        format=ConfigFormat.AXOLOTL,
        path=path,
        data=data,
        unmapped=tuple(notes),
        layout=file_layout,
    )


def _ranks(
    data: dict[str, Any], options: RankOptions, notes: list[str], used: set[str]
) -> tuple[int, int | None]:
    """The ranks, and the shard group when `dp_shard_size` shards over fewer of them.

    Raises:
        SpecError: tensor, context or expert parallelism; sizes that disagree.
    """
    for key in _MODEL_PARALLEL:
        size = data.get(key)
        if isinstance(size, int) and size > 1:
            raise refuse(key, f"{size}: splitting the model across GPUs is not modelled")
        used.add(key)
    # Axolotl sets up a device mesh only for sizes above 1 (setup_parallelism_envs).
    shard, replicate = (
        value if isinstance(value, int) and value > 1 else None
        for value in (data.get(_K["dp_shard_size"]), data.get(_K["dp_replicate_size"]))
    )
    used |= {_K["dp_shard_size"], _K["dp_replicate_size"], RAY_WORKERS, "use_ray"}
    said, key = None, _K["dp_shard_size"]
    if shard is not None and (replicate is not None or options.ranks() is None):
        said = shard * (replicate or 1)  # else the replicas fill the ranks the options give
    elif replicate is not None:
        raise refuse(_K["dp_replicate_size"], f"needs {_K['dp_shard_size']}")
    elif data.get("use_ray") and isinstance(data.get(RAY_WORKERS), int):
        said, key = data[RAY_WORKERS], RAY_WORKERS
    world = rank_count(options, said, key=key, notes=notes)
    if shard is not None and shard > world:
        raise refuse(_K["dp_shard_size"], f"{shard} is more than the {world} ranks")
    if shard is None or shard == world:
        return world, None
    if world % shard:
        raise refuse(_K["dp_shard_size"], f"{shard} does not divide the {world} ranks")
    return world, shard


def _layout(
    data: dict[str, Any], path: Path, shard_group: int | None, notes: list[str]
) -> Sharding:
    """The sharding the file sets up (hybrid: FSDP over `shard_group` ranks, replicated).

    Raises:
        SpecError: DeepSpeed and FSDP both, or a layout that is not modelled.
    """
    deepspeed = data.get(_K["deepspeed"])
    config, strategies = data.get(_K["fsdp_config"]), data.get(FSDP)
    fsdp = isinstance(config, dict) or bool(strategies)
    if deepspeed and fsdp:
        raise refuse(_K["deepspeed"], f"set with {_K['fsdp_config']} as well: Axolotl takes one")
    if deepspeed:
        found = referenced_sharding(deepspeed, key=_K["deepspeed"], base=path.parent, notes=notes)
        if shard_group is not None:
            raise refuse(_K["dp_shard_size"], "sharding within groups needs FSDP, not DeepSpeed")
        return found
    if not fsdp:
        if shard_group is not None:
            raise refuse(_K["dp_shard_size"], f"shards only with {_K['fsdp_config']}")
        return Sharding.NONE
    words = [str(word) for word in strategies] if isinstance(strategies, list) else []
    fsdp_config = dict(config) if isinstance(config, dict) else {}
    version = data.get(_K["fsdp_version"])
    if version is not None:
        fsdp_config["version"] = version
    # Axolotl runs FSDP1 unless fsdp_version says 2 (its _resolve_fsdp_version).
    found = fsdp_sharding(
        words, fsdp_config, key=_K["fsdp_config"], notes=notes, default_version=1
    )
    if shard_group is None or found is Sharding.NONE:
        return found
    if found is not Sharding.ZERO3:
        raise refuse(
            _K["dp_replicate_size"],
            f"hybrid sharding is modelled with full shards only (this is {found})",
        )
    return Sharding.HYBRID


def _precision(data: dict[str, Any], notes: list[str]) -> tuple[Precision, WeightsDtype]:
    """Axolotl's `bf16: true` loads the weights in bf16 and trains them so (`resolve_dtype`);
    its default `auto` does that on any GPU with bf16."""
    bf16 = data.get(_K["bf16"], "auto") or data.get("bfloat16")
    if data.get(_K["fp16"]) or data.get("float16"):
        notes.append(
            f"{_K['fp16']}: fp16 weights measured as fp32 weights under fp16 autocast "
            "(more memory than the run)"
        )
        return Precision.FP16, WeightsDtype.FP32
    if bf16 == "auto":
        notes.append(f"{_K['bf16']}: auto taken as true (a GPU with bf16)")
    if bf16:
        return Precision.BF16, WeightsDtype.BF16
    return Precision.FP32, WeightsDtype.FP32


def _lora(
    data: dict[str, Any], adapter: object, notes: list[str], used: set[str]
) -> LoraSpec | None:
    used |= {_K["adapter"], _K["lora_r"], _K["lora_alpha"], _K["lora_dropout"]}
    used |= {_K["lora_target_modules"], _K["lora_modules_to_save"], "lora_target_linear"}
    if adapter is None:
        return None
    if adapter != "lora":
        raise refuse(_K["adapter"], f"{adapter!r}: autotune models lora adapters only")
    targets: Any = data.get(_K["lora_target_modules"])
    if data.get("lora_target_linear") or targets is None:
        targets = "all-linear"
    elif isinstance(targets, str):
        targets = [targets]
    try:
        return LoraSpec(
            r=data.get(_K["lora_r"]) or DEFAULT_LORA_R,
            alpha=data.get(_K["lora_alpha"]) or DEFAULT_LORA_ALPHA,
            dropout=data.get(_K["lora_dropout"]) or 0.0,
            target_modules=targets,
            modules_to_save=list(data.get(_K["lora_modules_to_save"]) or []),
        )
    except ValueError as error:
        raise refuse(_K["adapter"], str(error).splitlines()[0]) from None
