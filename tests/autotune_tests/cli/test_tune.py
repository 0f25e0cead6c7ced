"""What `autotune tune` prints (autotune/cli/tune.py): the tables explained, no empty table,
an indivisible target answered before any trial, where it keeps its files."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from autotune.cli.main import main
from autotune.cli.options import AUTO_PROCESSES, processes_count, side_by_side_processes
from autotune.cli.tune import print_tune_result
from autotune.core.schemas import Infeasible
from tests.api_tests.factories import (
    EXPANDABLE,
    emulated_device,
    expandable_tune_result,
    tiny_spec,
    tune_result,
)


def printed(result: object) -> str:
    out = io.StringIO()
    print_tune_result(Console(file=out, width=100), result)  # type: ignore[arg-type]
    return " ".join(out.getvalue().split())


def test_the_probe_table_s_columns_are_explained() -> None:
    text = printed(tune_result(tiny_spec(), emulated_device()))
    assert "within headroom: the largest micro-batch that leaves 5% of the capacity free" in text
    assert "when accumulating: the same while the gradients of earlier micro-batches" in text
    assert "Measured configurations" in text


def test_the_allocator_settings_of_trials_and_recommendation_are_printed() -> None:
    out = io.StringIO()
    print_tune_result(
        Console(file=out, width=200), expandable_tune_result(tiny_spec(), emulated_device())
    )
    text = out.getvalue()
    assert "PYTORCH_ALLOC_CONF" in text.split("Measured configurations")[1]
    # The trial only expandable segments fit, and those under the device's settings.
    assert EXPANDABLE in text and "device's" in text
    assert f"per GPU, with PYTORCH_ALLOC_CONF={EXPANDABLE}" in " ".join(text.split())
    # Without such trials, no column.
    plain = io.StringIO()
    print_tune_result(Console(file=plain, width=200), tune_result(tiny_spec(), emulated_device()))
    assert "PYTORCH_ALLOC_CONF" not in plain.getvalue().split("Recommendation")[0]


def test_no_empty_table_of_measured_configurations() -> None:
    result = tune_result(tiny_spec(), emulated_device()).model_copy(
        update={
            "trials": [],
            "recommendation": None,
            "exports": None,
            "infeasible": Infeasible(reason="not even a micro-batch of 1 fits"),
        }
    )
    text = printed(result)
    assert "Measured configurations" not in text
    assert "No configuration hits the target: not even a micro-batch of 1 fits" in text


def test_an_indivisible_target_is_answered_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model: {preset: gpt2-tiny}\ntraining: {seq_len: 32, world_size: 2, "
        "target_global_batch: 7}\n"
    )
    argv = ["tune", str(spec), "--device", "cpu", "--memory", "1GiB"]
    assert main([*argv, "--db", f"sqlite:///{tmp_path / 'runs.db'}"]) == 1
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())
    assert "not divisible by world size 2" in out
    assert "nearest below 6, nearest above 8" in out
    assert "micro-batch" not in captured.err  # no probe ran
    assert not (tmp_path / "runs.db").exists()


AUTO_SPEC = (
    "model: {preset: mlp}\ntraining: {world_size: 2, sharding: auto, "
    "target_global_batch: 8, max_micro_batch: 4}\n"
)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("processes", ["1", "2", "auto"])
def test_tune_estimate_with_auto_sharding_prints_the_layouts_and_both_speeds(
    processes: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tune --estimate` on a sharding: auto spec: the layout table, each layout's reason,
    the recommendation naming its layout with samples/s per GPU and for the job, and the
    exports of that layout (JSON: the same result the table was printed from); with the
    layouts tuned two at a time, progress lines that name their layout."""
    monkeypatch.chdir(tmp_path)  # the plain loop goes to ./data
    spec = tmp_path / "spec.yaml"
    spec.write_text(AUTO_SPEC)
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    argv = ["tune", str(spec), "--estimate", "H100 80GB", "--db", db, "--processes", processes]
    assert main(argv) == 0
    captured = capsys.readouterr()
    at_a_time = {"1": 1, "2": 2, "auto": side_by_side_processes(4)}[processes]
    if at_a_time > 1:
        assert "zero1: probe, checkpointing off" in captured.err
    said = f"4 layouts, {at_a_time} at a time, each in a process of its own"
    assert (said in " ".join(captured.err.split())) == (at_a_time > 1)
    out = " ".join(captured.out.split())
    assert "Layouts on 2 GPU(s): the chosen one first" in out
    for name in ("none (DDP):", "zero1:", "zero2:", "zero3 (FSDP full shard):"):
        assert name in out
    assert "Recommendation:" in out and ", layout " in out
    assert "samples/s per GPU" in out and "samples/s for the job of 2 GPUs" in out


def test_processes_are_auto_or_a_count_of_at_least_one() -> None:
    assert processes_count("auto") == processes_count(" AUTO ") == AUTO_PROCESSES
    assert processes_count("3") == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            processes_count(bad)


def test_auto_processes_are_the_cores_this_process_may_use_up_to_the_layouts() -> None:
    cores = len(os.sched_getaffinity(0))
    assert side_by_side_processes(1) == 1
    assert side_by_side_processes(cores + 3) == cores
    # A process bound to one core tunes one layout at a time, whatever the machine has.
    bound = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from autotune.cli.options import side_by_side_processes as f; print(f(5))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert bound.stdout.strip() == "1"


@pytest.mark.parametrize(
    ("spec_text", "flags"),
    [
        (AUTO_SPEC, []),  # a device: one trial at a time
        (AUTO_SPEC.replace("sharding: auto", "sharding: zero2"), ["--estimate", "H100 80GB"]),
    ],
    ids=["no-estimate", "one-layout"],
)
def test_processes_outside_an_estimate_of_auto_sharding_exit_2_in_one_line(
    spec_text: str, flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text)
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    assert main(["tune", str(spec), "--db", db, "--processes", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert err == (
        "autotune: error: --processes: layouts are tuned side by side only in an estimate of "
        "sharding: auto (--estimate NAME)\n"
    )
    assert not (tmp_path / "runs.db").exists()
