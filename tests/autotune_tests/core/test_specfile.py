"""Spec files: valid ones load, invalid ones fail with one line naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from autotune.core.errors import SpecError
from autotune.core.schemas import OptimizerName, Precision, Spec
from autotune.core.specfile import load_spec

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_load(path: Path) -> None:
    spec = load_spec(path)
    assert spec.training.seq_len is not None


def test_yaml_and_json_give_the_same_spec(tmp_path: Path) -> None:
    yaml_path = tmp_path / "s.yaml"
    yaml_path.write_text("model: {preset: mlp}\ntraining: {precision: bf16, optimizer: sgd}\n")
    json_path = tmp_path / "s.json"
    json_path.write_text(
        '{"model": {"preset": "mlp"}, "training": {"precision": "bf16", "optimizer": "sgd"}}'
    )
    assert load_spec(yaml_path) == load_spec(json_path)
    assert load_spec(json_path).training.precision is Precision.BF16
    assert load_spec(json_path).training.optimizer is OptimizerName.SGD


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: {preset: gpt9}", "preset: unknown preset 'gpt9'"),
        ("model: {preset: mlp, factory: 'a.b:c'}", "give exactly one of preset, hf_config"),
        ("model: {}", "give exactly one of preset"),
        ("model: {factory: 'not a factory'}", 'factory: expected "package.module:function"'),
        (
            "model: {hf_config: {model_type: llama, auto_map: {AutoModel: evil.M}}}",
            "hf_config.auto_map: names remote code, which autotune never runs",
        ),
        ("model: {hf_config: {hidden_size: 8}}", 'hf_config: needs a "model_type"'),
        (
            "model: {preset: gpt2-tiny}\ntraining: {seq_len: 257}",
            "training.seq_len: 257 exceeds the max_seq_len 256 of preset 'gpt2-tiny'",
        ),
        (
            "model: {preset: cnn}\ntraining: {input_shape: [32, 32]}",
            "training.input_shape: the cnn preset needs [C, H, W], got [32, 32]",
        ),
        ("model: {preset: mlp}\ntraining: {precison: fp16}", "training.precison: Extra inputs"),
        (
            "model: {preset: mlp}\ntraining: {precision: fp8}",
            "training.precision: Input should be",
        ),
        (
            "model: {preset: mlp}\ntraining: {headroom: 1.5}",
            "training.headroom: Input should be less",
        ),
        (
            "model: {preset: mlp}\ntraining: {world_size: 0}",
            "training.world_size: Input should be",
        ),
        ("model: {preset: mlp}\ntraining: {seq_len: 64}", "training.seq_len: this model takes"),
        (
            "model: {preset: gpt2-tiny}\ntraining: {input_shape: [3]}",
            "training.input_shape: this is a",
        ),
        ("model: {hf_config: {model_type: llama}}", "training.seq_len: required for Hugging Face"),
        (
            "model: {preset: gpt2-tiny}\ntraining: {seq_len: 100, target_global_tokens: 4096}",
            "training.target_global_tokens: 4096 is not a multiple of seq_len 100 (packed "
            "sequences: every sample holds 100 tokens); the nearest token targets are 4000 (40 "
            "samples) and 4100 (41 samples)",
        ),
        (
            "model: {preset: gpt2-tiny}\ntraining: {target_global_tokens: 4096}",
            "training.target_global_tokens: needs training.seq_len",
        ),
        (
            "model: {preset: gpt2-tiny}\n"
            "training: {seq_len: 128, target_global_tokens: 4096, target_global_batch: 64}",
            "training.target_global_batch: 64, but target_global_tokens 4096 / seq_len 128 is 32",
        ),
        (
            "model: {preset: mlp}\ntraining: {weights: bf16}",
            "training.weights: bf16 weights compute in bf16; set precision: bf16",
        ),
        ("- just\n- a list", "spec: expected a mapping"),
        ("model: [unclosed", "not valid YAML"),
    ],
)
def test_invalid_specs_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_missing_file_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read spec file"):
        load_spec(tmp_path / "nope.yaml")


def test_validation_never_imports_the_factory(tmp_path: Path) -> None:
    import sys

    path = tmp_path / "spec.yaml"
    path.write_text("model: {factory: 'autotune_no_such_module_xyz:make'}\n")
    spec = load_spec(path)
    assert spec.model.factory == "autotune_no_such_module_xyz:make"
    assert "autotune_no_such_module_xyz" not in sys.modules


def test_the_readme_s_fine_tuning_specs_are_valid() -> None:
    """Each `training:` block of the README's fine-tuning section is a valid spec as written."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("### Fine-tuning:", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 6
    for block in blocks:
        training = yaml.safe_load(block)
        spec = Spec.model_validate(
            {
                "model": {"hf_config": {"model_type": "llama"}},
                "training": {"seq_len": 64, **training},
            }
        )
        assert spec.training.model_dump(exclude_unset=True).keys() >= training.keys()


def test_a_syntax_error_names_its_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("model:\n  preset: mlp\ntraining: {seq_len: 64\n")
    with pytest.raises(SpecError, match=r"spec.yaml: not valid YAML: line 4, column 1: "):
        load_spec(path)
    path = tmp_path / "spec.json"
    path.write_text('{"model": {"preset": "mlp"},\n "training": }')
    with pytest.raises(SpecError, match=r"spec.json: not valid json: line 2, column 14: "):
        load_spec(path)
