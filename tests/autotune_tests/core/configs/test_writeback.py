"""A recommendation written back into real files: only its keys change (the diff says so, the
comments and key order stay), a layout the tuner chose is written in the file's own keys, and
each consumer still accepts the file: Axolotl's own schema, transformers' `TrainingArguments`,
DeepSpeed's `DeepSpeedConfig`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from autotune.core.configs import Converted, RankOptions, load_training_file
from autotune.core.configs.writeback import recommended_settings, rewritten, unified_diff
from autotune.core.exports import build_exports
from autotune.core.schemas import Exports, Recommendation, Sharding
from tests.autotune_tests.core.configs.models import AXOLOTL_EXAMPLES
from tests.autotune_tests.core.configs.test_deepspeed import ZERO2, written
from tests.autotune_tests.core.configs.test_hf_args import saved_arguments


def recommendation(
    converted: Converted,
    micro_batch: int,
    *,
    checkpointing: bool,
    blocks: int | None = None,
    sharding: Sharding | None = None,
    transformers_version: str | None = None,
) -> tuple[Recommendation, Exports]:
    """`sharding`: the layout the tuner chose for a `sharding: auto` spec."""
    training = converted.spec.training
    target = training.required_target_global_batch()
    rec = Recommendation(
        micro_batch=micro_batch,
        accumulation_steps=target // (micro_batch * training.world_size),
        checkpointing=checkpointing,
        checkpointed_blocks=blocks,
        num_blocks=None if blocks is None else 2 * blocks,
        world_size=training.world_size,
        global_batch=target,
        samples_per_s=10.0,
        peak_bytes=1,
        capacity_bytes=2,
        sharding=sharding,
    )
    exports = build_exports(
        rec, token_model=True, transformers_version=transformers_version, training=training
    )
    return rec, exports


def changed_lines(before: str, after: str) -> list[str]:
    diff = unified_diff(before, after, "file").splitlines()
    return [line for line in diff[2:] if line[:1] in "+-"]


@pytest.mark.parametrize("name", ["llama-3-lora-1b.yml", "qwen3-8b-lora-fused-attn.yaml"])
def test_an_axolotl_example_keeps_everything_but_the_recommended_keys(
    tmp_path: Path, name: str
) -> None:
    path = tmp_path / name
    shutil.copy(AXOLOTL_EXAMPLES / name, path)
    converted = load_training_file(path)
    rec, exports = recommendation(converted, 4, checkpointing=False)
    before = path.read_text()
    settings, notes = recommended_settings(converted, rec, exports)
    after = rewritten(converted, before, settings)
    old_micro = converted.data["micro_batch_size"]
    old_accumulation = converted.data["gradient_accumulation_steps"]
    assert sorted(changed_lines(before, after)) == sorted(
        [
            f"-gradient_accumulation_steps: {old_accumulation}",
            "+gradient_accumulation_steps: 1",
            f"-micro_batch_size: {old_micro}",
            "+micro_batch_size: 4",
            "-gradient_checkpointing: true",
            "+gradient_checkpointing: false",
        ]
    )
    assert notes == []
    validated = axolotl_validated(after)
    assert (validated.micro_batch_size, validated.gradient_accumulation_steps) == (4, 1)
    assert validated.gradient_checkpointing is False


def axolotl_validated(text: str) -> object:
    pytest.importorskip("axolotl", reason="make env installs Axolotl's schema (no-deps)")
    import yaml
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    return validate_config(DictDefault(yaml.safe_load(text)))


def test_partial_checkpointing_is_written_as_the_flag_with_a_note(tmp_path: Path) -> None:
    path = tmp_path / "lora.yml"
    shutil.copy(AXOLOTL_EXAMPLES / "llama-3-lora-1b.yml", path)
    converted = load_training_file(path)
    rec, exports = recommendation(converted, 2, checkpointing=True, blocks=1)
    settings, notes = recommended_settings(converted, rec, exports)
    assert settings["gradient_checkpointing"] is True
    assert notes and "first 1 blocks" in notes[0]


def test_a_training_arguments_file_still_builds_its_arguments(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    path = saved_arguments(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=8)
    converted = load_training_file(path, model="org/model", seq_len=32)
    rec, exports = recommendation(converted, 8, checkpointing=True)
    before = path.read_text()
    after = rewritten(converted, before, recommended_settings(converted, rec, exports)[0])
    assert sorted(changed_lines(before, after)) == sorted(
        [
            '-  "gradient_accumulation_steps": 8,',
            '+  "gradient_accumulation_steps": 2,',
            '-  "gradient_checkpointing": false,',
            '+  "gradient_checkpointing": true,',
            '-  "activation_checkpointing": false,',
            '+  "activation_checkpointing": true,',
            '-  "per_device_train_batch_size": 2,',
            '+  "per_device_train_batch_size": 8,',
        ]
    )
    args = TrainingArguments(**json.loads(after))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 2)
    assert args.activation_checkpointing is True


def test_a_deepspeed_file_still_reads_as_a_config(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from tests.autotune_tests.core.exports.consumers import deepspeed_properties

    path = written(tmp_path, ZERO2)
    converted = load_training_file(path, model="org/model", seq_len=32)
    rec, exports = recommendation(converted, 8, checkpointing=True)
    before = path.read_text()
    settings, notes = recommended_settings(converted, rec, exports)
    after = rewritten(converted, before, settings)
    assert sorted(changed_lines(before, after)) == sorted(
        [
            '-    "train_micro_batch_size_per_gpu": 4,',
            '+    "train_micro_batch_size_per_gpu": 8,',
            '-    "gradient_accumulation_steps": 2,',
            '+    "gradient_accumulation_steps": 1,',
        ]
    )
    assert "DeepSpeed config cannot say" in notes[0]
    parsed = deepspeed_properties(json.loads(after), world_size=8)
    assert (parsed["micro_batch"], parsed["accumulation"], parsed["world_size"]) == (8, 1, 8)
    assert parsed["zero_stage"] == 2


# ---------------------------------------------------------------------------------------------
# The layout the tuner chose (--sharding auto), in the file's own keys.

AUTO = RankOptions(world_size=4, sharding=Sharding.AUTO)


def auto_file(tmp_path: Path, name: str) -> Path:
    """An Axolotl example next to Axolotl's DeepSpeed configs, as in its repository."""
    shutil.copytree(AXOLOTL_EXAMPLES / "deepspeed_configs", tmp_path / "deepspeed_configs")
    path = tmp_path / name
    shutil.copy(AXOLOTL_EXAMPLES / name, path)
    return path


def chosen(
    path: Path, sharding: Sharding, options: RankOptions = AUTO, **read: Any
) -> tuple[str, str, list[str]]:
    """The file's text before and after writing a recommendation measured with `sharding`
    (micro-batch 1, as many accumulation steps as the target needs), and the notes."""
    converted = load_training_file(path, ranks=options, **read)
    rec, exports = recommendation(
        converted, 1, checkpointing=True, sharding=sharding, transformers_version="5.24.0"
    )
    before = path.read_text()
    settings, notes = recommended_settings(converted, rec, exports)
    return before, rewritten(converted, before, settings), notes


def layout_lines(before: str, after: str) -> list[str]:
    """The changed lines that are not the batch or checkpointing keys."""
    batch = (
        "micro_batch_size",
        "per_device_train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "activation_checkpointing",
    )
    return [
        line
        for line in changed_lines(before, after)
        if not line[1:].strip().strip('"').startswith(batch)
    ]


def test_axolotl_deepspeed_path_takes_the_config_of_the_chosen_stage(tmp_path: Path) -> None:
    path = auto_file(tmp_path, "llama-3-lora-1b-ray.yml")  # deepspeed_configs/zero3.json
    options = RankOptions(sharding=Sharding.AUTO)  # the ranks: ray_num_workers 4
    before, after, notes = chosen(path, Sharding.ZERO2, options)
    assert layout_lines(before, after) == [
        "-deepspeed: deepspeed_configs/zero3.json",
        "+deepspeed: deepspeed_configs/zero2.json",
    ]
    assert notes == []
    validated = axolotl_validated(after)
    assert validated.deepspeed == "deepspeed_configs/zero2.json"  # type: ignore[attr-defined]
    stage = json.loads((tmp_path / validated.deepspeed).read_text())["zero_optimization"]  # type: ignore[attr-defined]
    assert stage["stage"] == 2
    # No sharding: the DeepSpeed key goes, the comments around it stay.
    before, after, _ = chosen(path, Sharding.NONE, options)
    assert layout_lines(before, after) == ["-deepspeed: deepspeed_configs/zero3.json"]
    assert "# save_first_step: true" in after
    assert not axolotl_validated(after).deepspeed  # type: ignore[attr-defined]


def test_axolotl_fsdp2_says_zero2_by_reshard_after_forward(tmp_path: Path) -> None:
    path = auto_file(tmp_path, "llama-3-3b-fp8-fsdp2.yaml")
    before, after, _ = chosen(path, Sharding.ZERO2)
    assert sorted(layout_lines(before, after)) == sorted(
        [
            "-  sharding_strategy: FULL_SHARD",
            "+  sharding_strategy: SHARD_GRAD_OP",
            "-  reshard_after_forward: true",
            "+  reshard_after_forward: false",
        ]
    )
    validated = axolotl_validated(after)
    assert validated.fsdp_config.reshard_after_forward is False  # type: ignore[attr-defined]
    assert validated.fsdp_version == 2  # type: ignore[attr-defined]


def test_axolotl_fsdp_becomes_deepspeed_for_zero1(tmp_path: Path) -> None:
    path = auto_file(tmp_path, "llama-3-fft-8b-liger-fsdp.yaml")  # FSDP1: fsdp, fsdp_config
    before, after, _ = chosen(path, Sharding.ZERO1)
    removed = [line for line in layout_lines(before, after) if line.startswith("-")]
    assert "-fsdp:" in removed and "-fsdp_config:" in removed
    validated = axolotl_validated(after)
    assert validated.fsdp_config is None  # type: ignore[attr-defined]
    assert validated.deepspeed["zero_optimization"]["stage"] == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("sharding", [Sharding.ZERO1, Sharding.NONE])
def test_axolotls_fsdp2_only_keys_go_with_fsdp(tmp_path: Path, sharding: Sharding) -> None:
    # fp8_enable_fsdp_float8_all_gather: Axolotl's schema refuses it without FSDP2.
    path = auto_file(tmp_path, "llama-3-3b-fp8-fsdp2.yaml")
    before, after, notes = chosen(path, sharding)
    assert "-fp8_enable_fsdp_float8_all_gather: true" in layout_lines(before, after)
    assert notes == [
        "fp8_enable_fsdp_float8_all_gather: removed with FSDP (Axolotl takes them only with it)"
    ]
    validated = axolotl_validated(after)
    assert validated.fsdp_version is None and validated.fsdp_config is None  # type: ignore[attr-defined]
    assert validated.fp8 is True  # type: ignore[attr-defined]
    stage = (validated.deepspeed or {}).get("zero_optimization", {}).get("stage")  # type: ignore[attr-defined]
    assert stage == (1 if sharding is Sharding.ZERO1 else None)


def test_axolotl_without_a_layout_gets_the_exports_fsdp2_keys(tmp_path: Path) -> None:
    path = auto_file(tmp_path, "llama-3-lora-1b.yml")
    before, after, _ = chosen(path, Sharding.ZERO3)
    lines = layout_lines(before, after)
    # adamw_8bit (bitsandbytes') under FSDP2 is measured as torchao's, which Axolotl takes.
    optimizer = ["-optimizer: adamw_8bit", "+optimizer: adamw_torch_8bit"]
    assert [line for line in lines if "optimizer" in line] == optimizer
    added = [line for line in lines if line not in optimizer]
    assert all(line.startswith("+") for line in added)
    assert "+fsdp_version: 2" in added and "+  reshard_after_forward: true" in added
    validated = axolotl_validated(after)
    assert validated.fsdp_config.reshard_after_forward is True  # type: ignore[attr-defined]


def test_a_layout_the_file_already_has_is_left_alone(tmp_path: Path) -> None:
    path = auto_file(tmp_path, "llama-3-3b-fp8-fsdp2.yaml")
    before, after, _ = chosen(path, Sharding.ZERO3)
    assert layout_lines(before, after) == []
    # Without --sharding the layout is the file's, measured on one rank or many: kept.
    before, after, _ = chosen(path, Sharding.NONE, RankOptions())
    assert layout_lines(before, after) == []


def test_deepspeed_json_stage_is_set_in_place(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from tests.autotune_tests.core.exports.consumers import deepspeed_properties

    path = written(tmp_path, ZERO2)  # 64 = 4 x 2 x 8 ranks; offload_optimizer
    options = RankOptions(sharding=Sharding.AUTO)
    before, after, _ = chosen(path, Sharding.ZERO3, options, model="org/model", seq_len=32)
    assert [line for line in changed_lines(before, after) if "stage" in line] == [
        '-        "stage": 2,',
        '+        "stage": 3,',
    ]
    assert json.loads(after)["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    parsed = deepspeed_properties(json.loads(after), world_size=8)
    assert (parsed["zero_stage"], parsed["micro_batch"], parsed["accumulation"]) == (3, 1, 8)


def test_training_arguments_fsdp_and_deepspeed(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    fsdp = saved_arguments(tmp_path, fsdp=True, fsdp_config={"reshard_after_forward": False})
    read = {"model": "org/model", "seq_len": 32}
    before, after, _ = chosen(fsdp, Sharding.ZERO3, **read)
    assert layout_lines(before, after) == [
        '-    "reshard_after_forward": false,',
        '+    "reshard_after_forward": true,',
    ]
    args = TrainingArguments(**json.loads(after))
    assert args.fsdp_config["reshard_after_forward"] is True

    ds_config = tmp_path / "ds" / "zero3.json"
    ds_config.parent.mkdir()
    shutil.copy(AXOLOTL_EXAMPLES / "deepspeed_configs" / "zero3.json", ds_config)
    deepspeed = saved_arguments(tmp_path, deepspeed=str(ds_config))
    before, after, notes = chosen(deepspeed, Sharding.ZERO1, **read)
    # No zero1.json beside it: the named file inlined at the chosen stage, said.
    inlined = json.loads(after)["deepspeed"]
    assert inlined["zero_optimization"] == {
        **json.loads(ds_config.read_text())["zero_optimization"],
        "stage": 1,
    }
    assert notes == [
        f"deepspeed: {ds_config} inlined with ZeRO stage 1 (no such file of that stage)"
    ]
    TrainingArguments(**json.loads(after))  # the Trainer takes it

    plain = saved_arguments(tmp_path)
    before, after, _ = chosen(plain, Sharding.ZERO2, **read)
    args = TrainingArguments(**json.loads(after))
    assert args.fsdp and args.fsdp_config["reshard_after_forward"] is False


@pytest.mark.parametrize("sharding", [Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2])
def test_transformers_4s_own_fsdp_arguments_leave_with_fsdp(
    tmp_path: Path, sharding: Sharding
) -> None:
    """A transformers 4 file: `fsdp` as words, and the two FSDP arguments 4.x had of its own
    (5 has neither), which 4.x warns about when `fsdp` is unset: they go when FSDP goes."""
    path = saved_arguments(tmp_path)
    legacy = {"fsdp_min_num_params": 0, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}
    path.write_text(
        json.dumps({**json.loads(path.read_text()), "fsdp": ["full_shard", "auto_wrap"], **legacy})
    )
    _, after, _ = chosen(path, sharding, model="org/model", seq_len=32)
    written = json.loads(after)
    if sharding is Sharding.ZERO2:
        assert written["fsdp"] == ["shard_grad_op", "auto_wrap"]
        assert {key: written[key] for key in legacy} == legacy
    else:
        assert not written["fsdp"]
        assert not set(legacy) & set(written)


def test_training_arguments_hybrid_is_fsdp2_with_its_groups_in_the_launch(tmp_path: Path) -> None:
    """transformers 5 writes FSDP2; its hybrid groups live in accelerate's ParallelismConfig,
    which a TrainingArguments file cannot hold: the note says how to launch, and accelerate's
    own config, read from that launch's environment, builds the measured mesh."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import TrainingArguments

    from tests.autotune_tests.core.exports.consumers import launched

    path = saved_arguments(tmp_path, fsdp=True, fsdp_config={"reshard_after_forward": False})
    options = RankOptions(nodes=2, gpus_per_node=2, sharding=Sharding.AUTO)
    before, after, notes = chosen(path, Sharding.HYBRID, options, model="org/model", seq_len=32)
    written = json.loads(after)
    assert (written["fsdp"], written["fsdp_config"]["version"]) == (True, 2)
    assert written["parallelism_config"] is None
    [note] = notes
    assert "--parallelism_config_dp_replicate_size 2 --parallelism_config_dp_shard_size 2" in note
    environment = dict(pair.split("=") for pair in note.split(" set ")[1].split())
    # The launch the note gives sets that environment (accelerate's own parser and launcher).
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    flags = note.split("accelerate launch ")[1].split(", or set")[0].split()
    parsed = launch_command_parser().parse_args([*flags, "--num_processes", "4", "train.py"])
    launch_environment = prepare_multi_gpu_env(_validate_launch_command(parsed)[0])
    assert environment.items() <= launch_environment.items()
    with launched(4):
        os.environ.update(environment)
        args = TrainingArguments(**written)
        plugin = args.fsdp_plugin_args
        assert (plugin["fsdp_version"], plugin["reshard_after_forward"]) == (2, True)
        mesh = ParallelismConfig().get_device_mesh("cpu")  # as Accelerator builds it
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert tuple(mesh.shape) == (2, 2)
