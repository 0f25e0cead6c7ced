"""`autotune probe --max-seq-len` and what `probe` and `tune` say when nothing fits, as a user
runs them: exit codes, the JSON document, the tables, and the refusals (one line, code 2)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.cli.main import main
from tests.autotune_tests.cli.test_main import in_process
from tests.autotune_tests.engine.test_sequence_probe import LONG_LLAMA

pytestmark = pytest.mark.slow

MLP_SPEC = "model: {preset: mlp}\ntraining: {target_global_batch: 8}\n"


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def long_llama(tmp_path: Path) -> Path:
    path = tmp_path / "long-llama.yaml"
    spec = {"model": {"hf_config": LONG_LLAMA}, "training": {"seq_len": 512, "precision": "bf16"}}
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.e2e
def test_the_longest_sequence_on_the_emulated_gpu_as_json(long_llama: Path) -> None:
    pytest.importorskip("transformers")
    argv = ["probe", str(long_llama), "--max-seq-len", "--memory", "50MiB", "--json"]
    code, out, err = _run(argv + ["--seq-cap", "320"])
    assert code == 0, err
    result = json.loads(out)
    assert (result["micro_batch"], result["step_tokens"], result["cap_tokens"]) == (1, 64, 320)
    assert [mode["checkpointing"] for mode in result["modes"]] == [False, True]
    for mode in result["modes"]:
        assert 0 < mode["max_seq_len"] <= 320 and mode["max_seq_len"] % 64 == 0
        fitted = {a["seq_len"] for a in mode["attempts"] if a["fits"]}
        assert mode["max_seq_len"] in fitted
    assert "tokens fits" in err and "out of memory" in err  # progress, one line per trial


@pytest.mark.e2e
def test_the_longest_sequence_in_an_estimate_stops_at_the_models_positions(
    long_llama: Path,
) -> None:
    pytest.importorskip("transformers")
    code, out, err = _run(["probe", str(long_llama), "--max-seq-len", "--estimate", "T4"])
    assert code == 0, err
    assert "estimate for T4" in out
    assert out.count("512 (cap 512)") == 2  # a tiny model: both modes reach its positions


def test_max_seq_len_refusals_name_the_problem(
    tmp_path: Path, long_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mlp = tmp_path / "mlp.yaml"
    mlp.write_text(MLP_SPEC)
    for argv, message in (
        ([str(mlp), "--memory", "50MiB"], "fixed-shape inputs"),
        ([str(long_llama), "--memory", "50MiB", "--seq-cap", "32"], "below one step"),
        ([str(long_llama), "--memory", "50MiB", "--seq-step", "0"], "must be >= 1"),
    ):
        code, err = in_process(["probe", *argv, "--max-seq-len"], capsys)
        assert code == 2, (argv, err)
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.e2e
def test_tune_says_what_would_make_it_fit_and_fails(tmp_path: Path) -> None:
    """40 MiB is too small for one sample of the mlp preset (1.9M parameters: 30 MB of fp32
    weights, gradients and AdamW states, in the allocator's 20 MiB segments); bf16 weights
    (22 MiB reserved), 8-bit AdamW (30 MiB) and ZeRO-3 on a few GPUs fit."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(MLP_SPEC)
    argv = ["tune", str(spec), "--device", "cpu", "--memory", "40MiB"]
    argv += ["--db", f"sqlite:///{tmp_path / 'runs.db'}"]
    code, out, err = _run([*argv, "--json"])
    assert code == 1, err
    advice = json.loads(out)["probe"]["fit_advice"]
    changes = [remedy["change"] for remedy in advice["remedies"]]
    assert {"bf16 weights", "8-bit AdamW"} <= set(changes)
    assert "LoRA" not in " ".join(changes + advice["still_too_large"])  # no token model
    assert any(change.endswith("GPUs with ZeRO-3 (FSDP full shard)") for change in changes)
    assert all(r["peak_bytes"] <= r["capacity_bytes"] == 40 * 2**20 for r in advice["remedies"])
    assert "tracing: more GPUs with ZeRO-3" in err

    code, out, _ = _run(argv)
    assert code == 1
    assert "not even a micro-batch of 1 fits" in out
    assert "What would make it fit" in out and "training.sharding: zero3" in out
    assert "Not modelled: CPU offload of the optimizer states" in out

    code, out, err = _run([*argv, "--json", "--no-advice"])
    assert code == 1 and json.loads(out)["probe"]["fit_advice"] is None
    assert "tracing" not in err


README = Path(__file__).resolve().parents[3] / "README.md"
README_COMMAND = "$ autotune probe examples/llama-3-8b-full.yaml --estimate "


def _readme_blocks() -> list[str]:
    """The README's `console` blocks of the Llama-3-8B command: the command, then its output."""
    blocks = re.findall(r"```console\n(.*?)```", README.read_text(), flags=re.DOTALL)
    return [block for block in blocks if block.startswith(README_COMMAND)]


def test_the_readme_shows_the_llama_3_8b_answers() -> None:
    """On one 80 GB card and on one 24 GB card."""
    cards = [block.splitlines()[0].removeprefix(README_COMMAND) for block in _readme_blocks()]
    assert cards == ['"H100 80GB"', '"RTX 4090"']


@pytest.mark.e2e  # each card traces some 30-60 steps of an 8B model: minutes on 2 cores
@pytest.mark.parametrize("block", _readme_blocks(), ids=lambda block: block.splitlines()[0])
def test_the_readmes_llama_3_8b_answers_are_what_the_command_prints(block: str) -> None:
    """The README's full fine-tuning of Llama-3-8B, run as written: its standard output is the
    README's, line for line."""
    command = block.splitlines()[0].removeprefix("$ ")
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli.main", *shlex.split(command)[1:]],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=README.parent,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert done.returncode == 0, done.stderr
    # Trailing blanks (rich pads a centred title) are not kept in the README.
    printed = [line.rstrip() for line in done.stdout.splitlines()]
    assert printed == block.splitlines()[1:]
