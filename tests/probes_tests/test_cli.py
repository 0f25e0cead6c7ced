"""`autotune worker` (probes/cli.py) argument handling, in process: bad input is exit code 2
and one line."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from autotune.cli.main import main

GIB = 2**30


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOTUNE_TOKEN", raising=False)
    monkeypatch.delenv("AUTOTUNE_SERVER", raising=False)


def test_a_token_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--device", "cpu", "--memory", "4GiB"]) == 2
    assert "--token: required (or set AUTOTUNE_TOKEN)" in capsys.readouterr().err


def test_the_emulated_device_needs_a_memory_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--token", "t", "--device", "cpu"]) == 2
    assert "--memory: required with the emulated cpu device" in capsys.readouterr().err


def test_a_named_gpu_is_one_of_memory_or_gpu_and_must_be_known(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (["--gpu", "T4", "--memory", "4GiB"], ["--gpu", "H100 PCIe"]):
        with pytest.raises(SystemExit) as exited:
            main(["worker", "--token", "t", *argv])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "not allowed with argument" in err or "unknown GPU 'H100 PCIe'; known: T4" in err
    assert main(["worker", "--token", "t", "--gpu", "T4", "--device", "cuda"]) == 2
    assert "--gpu: names a GPU to emulate on the cpu device" in capsys.readouterr().err


def test_the_inventory_of_a_named_gpu_offers_it_for_one_rank() -> None:
    from autotune.core.gpus.catalogue import find_gpu
    from autotune.core.gpus.cuda_reserve import budget_for
    from probes.inventory import default_device_name, read_inventory

    assert default_device_name("T4") == "cpu"
    (device,) = read_inventory("cpu", None, "tesla t4")
    assert (device.device_name, device.memory_bytes, device.gpu) == ("cpu", None, "tesla t4")
    assert device.info.gpu == "T4"
    assert device.info.capacity_bytes == budget_for(find_gpu("T4")).capacity_bytes


def test_the_estimate_inventory_offers_every_catalogue_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from autotune.core.gpus.catalogue import GPUS
    from autotune.core.schemas import DeviceKind
    from probes.inventory import read_inventory

    devices = read_inventory("estimate", None)
    assert [device.gpu for device in devices] == [gpu.name for gpu in GPUS]
    for device in devices:
        assert device.info.kind is DeviceKind.ESTIMATE and device.info.gpu == device.gpu
        assert device.info.name == f"estimate for {device.gpu}"
    assert main(["worker", "--token", "t", "--device", "estimate", "--memory", "4GiB"]) == 2
    assert "--device estimate: estimates every catalogue GPU" in capsys.readouterr().err


@pytest.mark.e2e
def test_cuda_without_a_gpu_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["worker", "--token", "t", "--device", "cuda:0"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--trial-timeout", "0"],
        ["--poll-interval", "-1"],
        ["--seconds-per-trial", "soon"],
        ["--start-method", "fork"],
        ["--memory", "lots"],
        ["--allow-factory", "my-pkg"],
        ["--allow-factory", "a..b"],
    ],
)
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["worker", "--token", "t", "--device", "cpu", "--memory", "1GiB", *argv])
    assert exited.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_signal_handlers_are_restored_after_the_command() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert main(["worker", "--token", "t", "--device", "cpu"]) == 2
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_registering_the_command_does_not_import_torch() -> None:
    """Every `autotune` command builds the whole parser; only the worker's children (and the
    worker once it tunes) need torch."""
    code = (
        "import sys\n"
        "from autotune.cli.main import build_parser\n"
        "parser = build_parser()\n"
        "parser.parse_args(['worker', '--device', 'cpu', '--memory', '1GiB'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_worker_reads_its_allocator_settings_once_and_refuses_bad_ones(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry point reads PYTORCH_ALLOC_CONF (a value torch refuses is a usage error naming
    it); the inventory models the settings it is given, not whatever the environment says
    later."""
    from autotune.core.memory.allocator_config import parse_alloc_conf
    from probes.inventory import read_inventory

    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:yes")
    assert main(["worker", "--token", "t", "--device", "cpu", "--memory", "4GiB"]) == 2
    err = capsys.readouterr().err
    assert "PYTORCH_ALLOC_CONF" in err and "expected True or False" in err
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:40")
    given = parse_alloc_conf("expandable_segments:True")
    (device,) = read_inventory("cpu", 4 * GIB, allocator_config=given)
    assert device.info.allocator_conf == "expandable_segments:True"
    (default,) = read_inventory("cpu", 4 * GIB)
    assert default.info.allocator_conf is None
