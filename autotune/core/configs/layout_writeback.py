"""The layout the tuner chose (`sharding: auto`, or `--sharding`), written back in the file's
own vocabulary (docs/design.md#config-files).

The file's framework is kept when it can express the layout: DeepSpeed (a dict, a path, a
DeepSpeed JSON's own `zero_optimization`) says ZeRO 1-3 by its stage; FSDP (`fsdp_config`,
`fsdp`) says zero3 and zero2 by `reshard_after_forward` (and FSDP1's strategy name where the
file has one), hybrid by Axolotl's `dp_shard_size`/`dp_replicate_size`; a TrainingArguments
file says FSDP2 and its notes the hybrid groups (accelerate's `ParallelismConfig`, which the
file cannot hold, set at launch), or FSDP1's `hybrid_shard` before transformers 5. Otherwise
the export's keys (ZeRO-1 through DeepSpeed, the others through FSDP) replace the other
framework's; no sharding (DDP) takes the layout keys out, with the keys Axolotl takes only with
FSDP2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from autotune.core.configs.conversion import ConfigFormat, Converted
from autotune.core.configs.edits import REMOVE, Merge
from autotune.core.exports.axolotl import AXOLOTL_KEYS
from autotune.core.exports.deepspeed import DEEPSPEED_KEYS
from autotune.core.exports.hf import HF_KEYS
from autotune.core.exports.measured import ZERO_STAGES
from autotune.core.schemas import Exports, OptimizerName, Recommendation, Sharding

_ZERO = DEEPSPEED_KEYS["zero"]
_DEEPSPEED_LAYOUTS = frozenset({Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3})
_FSDP_LAYOUTS = frozenset({Sharding.ZERO2, Sharding.ZERO3, Sharding.HYBRID})
# FSDP1's strategy for each layout, as its words and its upper-case sharding_strategy.
_FSDP1 = {
    Sharding.ZERO3: "full_shard",
    Sharding.ZERO2: "shard_grad_op",
    Sharding.HYBRID: "hybrid_shard",
}
_STRATEGY_WORDS = frozenset({*_FSDP1.values(), "no_shard", "hybrid_shard_zero2"})
_STAGE_IN_NAME = re.compile(r"zero[0-3]")
_AX_FSDP_KEYS = ("fsdp", AXOLOTL_KEYS["fsdp_config"], AXOLOTL_KEYS["fsdp_version"])
_AX_GROUP_KEYS = (AXOLOTL_KEYS["dp_shard_size"], AXOLOTL_KEYS["dp_replicate_size"])
# Axolotl keys its schema accepts only with FSDP2 (its validators of AXOLOTL_VERSION: "requires
# FSDP2"), which go with the FSDP keys (docs/design.md#config-files).
_AX_FSDP_ONLY_KEYS = ("fp8_enable_fsdp_float8_all_gather", "fp32_norms", "fp32_norm_classes")


def measured_layout(converted: Converted, rec: Recommendation) -> Sharding | None:
    """The layout to write: the one measured, when the options chose it (`--sharding`, `auto`)
    and it is not the file's; None when the file's layout stays."""
    training = converted.spec.training
    chosen = rec.sharding if training.sharding is Sharding.AUTO else training.sharding
    if chosen is None or chosen is converted.layout:
        return None
    if training.sharding is not Sharding.AUTO and training.world_size < 2:
        return None  # one rank: the file's layout is for its many ranks
    return chosen


def layout_settings(
    converted: Converted, rec: Recommendation, exports: Exports
) -> tuple[dict[str, Any], list[str]]:
    """The edits that set the measured layout in the file, and what the file cannot say."""
    chosen = measured_layout(converted, rec)
    if chosen is None:
        return {}, []
    notes: list[str] = []
    data: dict[str, Any] = converted.data
    base = converted.path.parent
    if converted.format is ConfigFormat.DEEPSPEED:
        if chosen is Sharding.HYBRID:
            notes.append(
                "layout: hybrid sharding cannot be said in DeepSpeed 0.19 (no MiCS): ZeRO-3 "
                "over all ranks written (less memory per rank, more traffic across nodes)"
            )
        return {_ZERO: Merge(stage=ZERO_STAGES.get(chosen, 0))}, notes
    if converted.format is ConfigFormat.AXOLOTL:
        edits = _axolotl(data, chosen, exports, base, notes)
        optimizer_key, export = AXOLOTL_KEYS["optimizer"], exports.axolotl
    else:
        edits = _hf(data, chosen, exports, base, notes)
        optimizer_key, export = HF_KEYS["optimizer"], exports.hf
    # 8-bit AdamW is measured as torchao's under FSDP2 (the one Axolotl and the Trainer take
    # there; bitsandbytes' otherwise): written with the FSDP keys.
    eight_bit = converted.spec.training.optimizer is OptimizerName.ADAMW_8BIT
    deepspeed_after = edits.get(HF_KEYS["deepspeed"], data.get(HF_KEYS["deepspeed"]))
    fsdp_written = chosen in _FSDP_LAYOUTS and deepspeed_after in (None, REMOVE)
    if (
        eight_bit
        and fsdp_written
        and export.get(optimizer_key) not in (None, data.get(optimizer_key))
    ):
        edits[optimizer_key] = export[optimizer_key]
    return edits, notes


def _deepspeed_value(
    value: object, chosen: Sharding, key: str, base: Path, notes: list[str]
) -> object:
    """The file's DeepSpeed setting (`value`: a dict or a path) at stage `chosen`: a dict
    merged; a path to Axolotl's config of that stage when it is here (`zero3.json` ->
    `zero2.json`), else the file it names inlined with the stage changed."""
    stage = ZERO_STAGES[chosen]
    if isinstance(value, dict):
        return Merge({_ZERO: Merge(stage=stage)})
    text = str(value)
    sibling = _STAGE_IN_NAME.sub(f"zero{stage}", text)
    if sibling != text and any(path.is_file() for path in (Path(sibling), base / sibling)):
        return sibling
    inlined: dict[str, Any] = {}
    for path in (Path(text), base / text):
        if path.is_file():
            inlined = json.loads(path.read_text(encoding="utf-8"))
            break
    zero = dict(inlined.get(_ZERO) or {})
    inlined[_ZERO] = {**zero, "stage": stage}
    notes.append(f"{key}: {text} inlined with ZeRO stage {stage} (no such file of that stage)")
    return inlined


def _axolotl(
    data: dict[str, Any], chosen: Sharding, exports: Exports, base: Path, notes: list[str]
) -> dict[str, Any]:
    deepspeed_key, config_key = AXOLOTL_KEYS["deepspeed"], AXOLOTL_KEYS["fsdp_config"]
    fsdp_keys: tuple[str, ...] = (*_AX_FSDP_KEYS, *_AX_GROUP_KEYS)
    dropped = [key for key in _AX_FSDP_ONLY_KEYS if key in data]
    if dropped and chosen not in _FSDP_LAYOUTS:
        fsdp_keys += tuple(dropped)
        notes.append(f"{', '.join(dropped)}: removed with FSDP (Axolotl takes them only with it)")
    remove_fsdp = {key: REMOVE for key in fsdp_keys if key in data}
    if chosen is Sharding.NONE:
        return {**remove_fsdp, **({deepspeed_key: REMOVE} if deepspeed_key in data else {})}
    if data.get(deepspeed_key) and chosen in _DEEPSPEED_LAYOUTS:
        return {
            deepspeed_key: _deepspeed_value(
                data[deepspeed_key], chosen, deepspeed_key, base, notes
            )
        }
    fsdp_config = data.get(config_key)
    if (isinstance(fsdp_config, dict) or data.get("fsdp")) and chosen in _FSDP_LAYOUTS:
        edits: dict[str, Any] = {
            config_key: _fsdp_config(fsdp_config if isinstance(fsdp_config, dict) else {}, chosen)
        }
        words = data.get("fsdp")
        if isinstance(words, list):
            edits["fsdp"] = _with_strategy(words, chosen)
        edits.update(_groups(data, chosen, exports))
        return edits
    # The other framework, or none: the export's keys in place of the file's.
    edits = {key: REMOVE for key in (*fsdp_keys, deepspeed_key)}
    edits = {key: value for key, value in edits.items() if key in data}
    layout_keys = (deepspeed_key, *_AX_FSDP_KEYS, *_AX_GROUP_KEYS)
    edits.update({key: exports.axolotl[key] for key in layout_keys if key in exports.axolotl})
    return edits


def _fsdp_config(config: dict[str, Any], chosen: Sharding) -> Merge:
    """`reshard_after_forward` under the name the file uses (with or without `fsdp_`), and
    FSDP1's `sharding_strategy` where the file names one."""
    prefix = "fsdp_" if "fsdp_reshard_after_forward" in config else ""
    edits = Merge({f"{prefix}reshard_after_forward": chosen is not Sharding.ZERO2})
    for name in ("sharding_strategy", "fsdp_sharding_strategy"):
        if name in config:
            edits[name] = _FSDP1[chosen].upper()
    return edits


def _with_strategy(words: list[Any], chosen: Sharding) -> list[Any]:
    """FSDP1's words with the strategy word replaced (kept in place, or put first)."""
    kept = [word for word in words if str(word).lower() not in _STRATEGY_WORDS]
    return [_FSDP1[chosen], *kept]


def _groups(data: dict[str, Any], chosen: Sharding, exports: Exports) -> dict[str, Any]:
    """Axolotl's device mesh: the export's shard groups for hybrid, none (all ranks shard)
    otherwise."""
    if chosen is not Sharding.HYBRID:
        return {key: REMOVE for key in _AX_GROUP_KEYS if key in data}
    return {key: exports.axolotl[key] for key in _AX_GROUP_KEYS}


# transformers 4's FSDP arguments of their own (5 has neither): meaningless without `fsdp`, and
# 4.x warns about each one left beside it, so they leave with it.
_HF4_FSDP_ONLY_KEYS = ("fsdp_min_num_params", "fsdp_transformer_layer_cls_to_wrap")


def _hf(
    data: dict[str, Any], chosen: Sharding, exports: Exports, base: Path, notes: list[str]
) -> dict[str, Any]:
    """TrainingArguments' `deepspeed` and `fsdp`/`fsdp_config`, and transformers 4's own FSDP
    arguments when FSDP goes."""
    edits = _hf_layout(data, chosen, exports, base, notes)
    fsdp_key = HF_KEYS["fsdp"]
    if not edits.get(fsdp_key, data.get(fsdp_key)):
        edits.update({key: REMOVE for key in _HF4_FSDP_ONLY_KEYS if key in data})
    return edits


def _hf_layout(
    data: dict[str, Any], chosen: Sharding, exports: Exports, base: Path, notes: list[str]
) -> dict[str, Any]:
    """TrainingArguments' `deepspeed` and `fsdp`/`fsdp_config` (their unset value is null)."""
    deepspeed_key, fsdp_key, config_key = HF_KEYS["deepspeed"], HF_KEYS["fsdp"], "fsdp_config"
    unset = {key: None for key in (deepspeed_key, fsdp_key, config_key) if data.get(key)}
    if chosen is Sharding.NONE:
        return unset
    if data.get(deepspeed_key) and chosen in _DEEPSPEED_LAYOUTS:
        return {
            deepspeed_key: _deepspeed_value(
                data[deepspeed_key], chosen, deepspeed_key, base, notes
            )
        }
    fsdp = data.get(fsdp_key)
    config = data.get(config_key) if isinstance(data.get(config_key), dict) else {}
    assert isinstance(config, dict)
    if chosen is Sharding.HYBRID:
        return {**unset, **_hf_hybrid(exports, notes)}
    if fsdp and chosen in _FSDP_LAYOUTS:
        if isinstance(fsdp, list | str):  # transformers 4's words
            words = fsdp.split() if isinstance(fsdp, str) else fsdp
            joined = _with_strategy(list(words), chosen)
            return {fsdp_key: " ".join(joined) if isinstance(fsdp, str) else joined}
        version = str(config.get("version", 2))
        reshard: object = chosen is not Sharding.ZERO2
        if version != "2":
            reshard = _FSDP1[chosen]
        return {config_key: Merge(reshard_after_forward=reshard)}
    edits = dict(unset)
    for key in (deepspeed_key, fsdp_key, config_key):
        if key in exports.hf:
            edits[key] = exports.hf[key]
    return edits


# accelerate's environment for its `ParallelismConfig`, which `Accelerator` reads when given no
# config, and which `accelerate launch` sets only given `--use_parallelism_config` (its sizes'
# flags alone set nothing), refused without `--use_fsdp --fsdp_version 2`
# (docs/design.md#config-files; the test runs accelerate's own launch parser).
PARALLELISM_LAUNCH = "--use_fsdp --fsdp_version 2 --use_parallelism_config"
PARALLELISM_ENV = {
    "on": "ACCELERATE_USE_PARALLELISM_CONFIG",
    "replicate": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "shard": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
}


def _hf_hybrid(exports: Exports, notes: list[str]) -> dict[str, Any]:
    """Hybrid sharding in a TrainingArguments file. FSDP2 (the export's, transformers 5): its
    keys, with the groups said in the notes, since they live in accelerate's
    `ParallelismConfig`, which the file cannot hold (`TrainingArguments.to_dict` writes it as
    null); before transformers 5, FSDP1's `hybrid_shard`, which shards within each node."""
    fsdp_key, config_key = HF_KEYS["fsdp"], HF_KEYS["fsdp_config"]
    if exports.hf.get(fsdp_key) is not True:
        notes.append(f"{fsdp_key}: hybrid written as FSDP1's hybrid_shard (within each node)")
        return {
            fsdp_key: True,
            config_key: Merge(version=1, reshard_after_forward=_FSDP1[Sharding.HYBRID]),
        }
    groups = exports.hf["parallelism_config"]
    replicate, shard = groups["dp_replicate_size"], groups["dp_shard_size"]
    notes.append(
        f"parallelism_config: FSDP2 written; its hybrid groups ({replicate} x {shard} ranks) "
        f"cannot be held by the file: launch with accelerate launch {PARALLELISM_LAUNCH} "
        f"--parallelism_config_dp_replicate_size {replicate} "
        f"--parallelism_config_dp_shard_size {shard}, or set "
        f"{PARALLELISM_ENV['on']}=true {PARALLELISM_ENV['replicate']}={replicate} "
        f"{PARALLELISM_ENV['shard']}={shard}"
    )
    return {fsdp_key: True, config_key: Merge(version=2, reshard_after_forward=True)}
