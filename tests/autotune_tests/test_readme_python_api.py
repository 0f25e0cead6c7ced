"""The README's "Use it from your code" examples, extracted from README.md and run as written:
the Python API block executed, and the config-file commands run on the Axolotl example they
name, with a tiny Llama in the directory they name."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from autotune.cli.main import main
from tests.autotune_tests.core.configs.models import AXOLOTL_EXAMPLES, tiny_llama_directory

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(start: str) -> list[str]:
    section = README.read_text().split("### Use it from your code\n", 1)[1].split("\n### ", 1)[0]
    return [
        b for b in re.findall(r"```\w*\n(.*?)```", section, flags=re.DOTALL) if b.startswith(start)
    ]


@pytest.mark.e2e
def test_the_python_api_examples_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    [api] = _blocks("import torch")
    [trainer] = _blocks("from transformers import Trainer")
    monkeypatch.chdir(tmp_path)  # the Trainer's output_dir="out"
    namespace = {"__name__": "readme"}
    exec(compile(api, "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "checkpointing False max micro-batch" in out
    assert "checkpointing True max micro-batch" in out
    assert "'per_device_train_batch_size'" in out
    exec(compile(trainer, "README.md", "exec"), namespace)  # "continuing the example above"
    tuned = namespace["args"]
    assert tuned.per_device_train_batch_size * tuned.gradient_accumulation_steps == 8  # type: ignore[attr-defined]
    assert "tuned: " in capsys.readouterr().out


@pytest.mark.e2e
def test_the_config_file_commands_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    [block] = _blocks("autotune tune")
    monkeypatch.chdir(tmp_path)
    shutil.copy(AXOLOTL_EXAMPLES / "llama-3-lora-1b.yml", "lora-1b.yml")
    tiny_llama_directory(tmp_path, max_position_embeddings=4096).rename("tiny-llama")
    before = Path("lora-1b.yml").read_text()
    first, second = block.strip().splitlines()
    db = ["--db", f"sqlite:///{tmp_path / 'runs.db'}"]
    assert main(shlex.split(first, comments=True)[1:] + db) == 0
    assert "+micro_batch_size:" in capsys.readouterr().out
    assert Path("lora-1b.yml").read_text() == before
    assert main(shlex.split(second, comments=True)[1:] + db) == 0
    assert Path("lora-1b.yml").read_text() != before


def test_the_lightning_example_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    [block] = _blocks("import lightning")
    monkeypatch.chdir(tmp_path)  # Lightning's checkpoints, if any, land here
    namespace: dict[str, object] = {"__name__": "readme"}
    exec(compile(block, "README.md", "exec"), namespace)
    callback, trainer = namespace["callback"], namespace["trainer"]
    micro = callback.optimal_batch_size  # type: ignore[attr-defined]
    accumulation = trainer.accumulate_grad_batches  # type: ignore[attr-defined]
    assert micro * accumulation == 256
    assert trainer.global_step == 2  # type: ignore[attr-defined]
    assert f"tuned: {micro} x {accumulation}" in capsys.readouterr().out
