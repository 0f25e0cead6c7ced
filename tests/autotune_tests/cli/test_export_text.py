"""Exports as a user pastes them (autotune/cli/export_text.py): never wrapped nor cut, whatever
the terminal's width, and `--export NAME` prints one alone."""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from autotune.cli.export_text import EXPORT_KEYS, print_one_export
from autotune.cli.tune import loop_path, print_tune_result
from autotune.core.exports import render_exports
from autotune.core.schemas import LoraSpec, ModelSpec, Spec, TrainingSpec, TuneResult
from tests.api_tests.factories import emulated_device, tune_result


def lora_result() -> TuneResult:
    spec = Spec(
        model=ModelSpec(preset="gpt2-tiny"),
        training=TrainingSpec(
            seq_len=64,
            target_global_batch=32,
            lora=LoraSpec(r=16, alpha=32, dropout=0.05, modules_to_save=["lm_head"]),
        ),
    )
    return tune_result(spec, emulated_device())


@pytest.mark.parametrize("width", [40, 80])
def test_every_export_line_is_printed_whole_at_any_width(width: int, tmp_path: Path) -> None:
    result = lora_result()
    assert result.exports is not None
    out = io.StringIO()
    path = tmp_path / "loop.py"
    print_tune_result(Console(file=out, width=width), result, loop_path=path)
    printed = out.getvalue().splitlines()
    texts = render_exports(result.exports)
    assert "lora_dropout=0.05" in texts["hf"]  # the value a cut made read 0.0
    for key, text in texts.items():
        if key == "pytorch_loop":
            continue
        for line in text.rstrip("\n").splitlines():
            assert line in printed, f"{key}: {line!r} cut or wrapped at width {width}"
    # The plain loop, a whole program, goes to a file, and the output says where.
    assert path.read_text() == texts["pytorch_loop"]
    assert any(str(path) in line for line in out.getvalue().replace("\n", "").split("written"))


@pytest.mark.parametrize("name", sorted(EXPORT_KEYS))
def test_one_export_alone_is_exactly_its_text(name: str) -> None:
    result = lora_result()
    assert result.exports is not None
    out, err = io.StringIO(), io.StringIO()
    print_one_export(Console(file=out, width=30), Console(file=err), result.exports, name)
    text = render_exports(result.exports)[EXPORT_KEYS[name]]
    assert out.getvalue() == text.rstrip("\n") + "\n"
    if name == "deepspeed":
        json.loads(out.getvalue())  # the JSON alone: its notes go to stderr
        assert "what the JSON cannot say" in err.getvalue()


@pytest.mark.e2e
@pytest.mark.slow
def test_tune_export_pytorch_prints_the_loop_alone_piped_in_a_narrow_terminal(
    tmp_path: Path,
) -> None:
    (tmp_path / "spec.yaml").write_text(
        "model: {preset: mlp}\ntraining: {target_global_batch: 8}\n"
    )
    argv = ["tune", "spec.yaml", "--device", "cpu", "--memory", "64MiB", "--export", "pytorch"]
    argv += ["--seconds-per-trial", "0.05", "--db", f"sqlite:///{tmp_path / 'runs.db'}"]
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=os.environ | {"COLUMNS": "40"},
    )
    assert done.returncode == 0, done.stderr
    loop = ast.parse(done.stdout)  # the program alone on stdout, no table, no progress
    names = {
        t.id
        for node in loop.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    assert {"MICRO_BATCH", "ACCUMULATION_STEPS", "WORLD_SIZE"} <= names
    assert max(len(line) for line in done.stdout.splitlines()) > 40  # not folded at 40
    assert "Recommendation" not in done.stdout
    # The study's plan, and each measurement as "trial i of N".
    planned = re.search(r"measure: (\d+) of \d+ configurations", done.stderr)
    assert planned is not None, done.stderr
    assert f"trial 1 of {planned[1]}: micro-batch" in done.stderr


def test_tune_refuses_json_and_export_together(capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["tune", "spec.yaml", "--json", "--export", "hf"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_loop_file_is_named_after_the_model_and_the_configuration(tmp_path: Path) -> None:
    assert loop_path(lora_result(), tmp_path) == tmp_path / "train_loop-gpt2-tiny-8x4.py"
