"""`autotune tune|probe FILE` on real Axolotl example configs (tests/data/axolotl/SOURCE.md),
with a tiny model of the same family standing in for the hub model: the recommendation as a
diff against the file, `--write` changing only its keys, and refusals that exit 2 naming the
field (autotune/cli/config_files.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from autotune.cli.main import main
from autotune.core.configs.writeback import unified_diff
from tests.autotune_tests.core.configs.models import (
    AXOLOTL_EXAMPLES,
    tiny_llama_directory,
    tiny_qwen3_directory,
)
from tests.autotune_tests.core.configs.test_writeback import axolotl_validated, changed_lines

LONG_CONTEXT = {"max_position_embeddings": 4096}  # the examples train at 2048 and 4096 tokens


def tune(tmp_path: Path, config: Path, model: Path, *extra: str) -> int:
    # An estimate for a named GPU: the examples' 2048-4096 tokens, traced, in seconds.
    return main(
        [
            "tune",
            str(config),
            "--model",
            str(model),
            "--estimate",
            "T4",
            "--trials",
            "1",
            "--json",
            "--db",
            f"sqlite:///{tmp_path / 'runs.db'}",
            *extra,
        ]
    )


def copied(tmp_path: Path, name: str) -> tuple[Path, str]:
    config = tmp_path / name
    shutil.copy(AXOLOTL_EXAMPLES / name, config)
    return config, config.read_text()


@pytest.mark.e2e
def test_tune_prints_the_diff_and_leaves_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, before = copied(tmp_path, "llama-3-lora-1b.yml")
    model = tiny_llama_directory(tmp_path, **LONG_CONTEXT)
    assert tune(tmp_path, config, model) == 0
    err = capsys.readouterr().err
    assert f"read {config} (Axolotl config); not mapped or assumed:" in err
    assert "attn_implementation: not modelled" in err
    assert f"--- {config} (before)" in err and "+micro_batch_size: " in err
    assert config.read_text() == before


@pytest.mark.e2e
def test_tune_write_changes_only_the_recommended_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, before = copied(tmp_path, "qwen3-8b-lora-fused-attn.yaml")
    model = tiny_qwen3_directory(tmp_path, **LONG_CONTEXT)
    assert tune(tmp_path, config, model, "--write") == 0
    after = config.read_text()
    err = capsys.readouterr().err
    assert unified_diff(before, after, str(config)) in err
    assert f"wrote {config}" in err
    changed = {line[1:].split(":")[0] for line in changed_lines(before, after)}
    assert changed <= {"micro_batch_size", "gradient_accumulation_steps", "gradient_checkpointing"}
    assert "micro_batch_size" in changed  # 1 x 4 on a T4 becomes 4 x 1 for the tiny model
    # The comments stay, and Axolotl's own schema takes the file.
    assert "# Opt-in fused RMSNorm + RoPE Triton kernel for Qwen3 attention." in after
    validated = axolotl_validated(after)
    assert validated.micro_batch_size * validated.gradient_accumulation_steps == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["llama-3-qlora-1b.yml", "qwen3-32b-qlora.yaml"])
def test_a_qlora_config_exits_2_naming_the_adapter(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["probe", str(AXOLOTL_EXAMPLES / name), "--estimate", "T4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("autotune: error: ")
    assert f"{name}: adapter: qlora trains adapters on a 4-bit base" in err


def test_a_deepspeed_file_without_a_model_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 4}')
    assert main(["probe", str(config), "--estimate", "T4"]) == 2
    assert "ds.json: --model: a DeepSpeed config names no model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--world-size", "8"],
            "llama-3-lora-1b-ray.yml: ray_num_workers: 4 ranks, but the options say 8",
        ),
        (["--nodes", "2"], "llama-3-lora-1b-ray.yml: --nodes: needs --gpus-per-node"),
    ],
)
def test_rank_options_reach_the_conversion_and_a_contradiction_exits_2(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = AXOLOTL_EXAMPLES / "llama-3-lora-1b-ray.yml"
    assert main(["probe", str(config), "--estimate", "T4", *options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_sharding_takes_the_layouts_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    config = AXOLOTL_EXAMPLES / "llama-3-lora-1b.yml"
    with pytest.raises(SystemExit) as exited:
        main(["tune", str(config), "--sharding", "zero4", "--estimate", "T4"])
    assert exited.value.code == 2
    assert "--sharding: invalid choice: 'zero4' (choose from 'none', 'zero1'" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("spec", ["gpt2-tiny", "spec.yaml"])
def test_submit_write_needs_a_config_file(
    spec: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before the server is asked (none listens on port 9)."""
    (tmp_path / "spec.yaml").write_text("model: {preset: gpt2-tiny}\ntraining: {seq_len: 8}\n")
    target = str(tmp_path / spec) if spec.endswith(".yaml") else spec
    argv = ["submit", target, "--write", "--device", "cpu:1GiB", "--server", "http://127.0.0.1:9"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--write: only a config file" in err


def test_probe_sharding_auto_exits_2_naming_the_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A probe runs one layout; auto is tune's choice among them: refused before any model is
    built (it raised a KeyError from the step's sharding once)."""
    config, before = copied(tmp_path, "llama-3-lora-1b-ray.yml")
    model = tiny_llama_directory(tmp_path, **LONG_CONTEXT)
    argv = ["probe", str(config), "--model", str(model), "--estimate", "T4", "--json"]
    assert main([*argv, "--sharding", "auto"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[-1] == (
        "autotune: error: training.sharding: auto is the choice the autotune tune command and "
        "the server's runs make by measuring every layout; one session runs one: set one of "
        "none, zero1, zero2, zero3, hybrid (--sharding for a config file)"
    )
    assert config.read_text() == before


@pytest.mark.e2e
def test_tune_sharding_auto_writes_the_chosen_layout_in_the_files_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Ray example (deepspeed_configs/zero3.json, 4 workers) tuned over every layout: the
    chosen one is written back as Axolotl's DeepSpeed config of that stage, or as FSDP keys,
    and Axolotl's schema takes the file."""
    import json

    shutil.copytree(AXOLOTL_EXAMPLES / "deepspeed_configs", tmp_path / "deepspeed_configs")
    config, before = copied(tmp_path, "llama-3-lora-1b-ray.yml")
    model = tiny_llama_directory(tmp_path, **LONG_CONTEXT)
    assert tune(tmp_path, config, model, "--sharding", "auto", "--write") == 0
    captured = capsys.readouterr()
    chosen = json.loads(captured.out)["recommendation"]["sharding"]
    after = config.read_text()
    validated = axolotl_validated(after)
    layout_keys = {"deepspeed", "fsdp_version", "fsdp_config", "optimizer"}
    changed = {line[1:].split(":")[0] for line in changed_lines(before, after)}
    assert changed - {"micro_batch_size", "gradient_accumulation_steps"} <= {
        "gradient_checkpointing",
        *layout_keys,
        " ",  # lines inside a new fsdp_config
    }
    if chosen in ("zero1", "zero2", "zero3"):
        assert validated.deepspeed == f"deepspeed_configs/zero{chosen[-1]}.json"  # type: ignore[attr-defined]
    else:
        assert chosen == "none" and not validated.deepspeed  # type: ignore[attr-defined]
    assert f"wrote {config}" in captured.err
