"""The command-line options every `autotune` command shares, each parsed and validated once,
here, at the boundary: memory sizes, GPU names, counts and durations, the device options
(`--device`, and `--memory` or `--gpu`) and the server pair (`--server`, `--token`). The
server's and the worker's commands (`api.cli`, `probes.cli`) use these too, so a value means
the same in every command.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from autotune.core.bytesize import parse_bytes
from autotune.core.defaults import DEFAULT_SERVER_URL, ENV_SERVER_URL, ENV_TOKEN, EXIT_USAGE
from autotune.core.errors import SpecError
from autotune.core.gpus.catalogue import UnknownGpu, find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.memory.allocator_config import (
    AllocatorConfig,
    AllocatorConfigError,
    config_from_environ,
)
from autotune.core.parallel.topology import box_problem

if TYPE_CHECKING:
    from autotune.core.schemas import DeviceInfo, Spec
    from autotune.engine.devices.device import Device
    from autotune.engine.probe import ExpandableSegments, FitTracer
    from autotune.engine.runner import TrialRunner

# What `add_subparsers()` returns (a private argparse class); every `register` function takes it.
Subcommands: TypeAlias = "argparse._SubParsersAction[CommandParser]"


class CommandParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit code 2), and a value that
    starts with a minus and a digit (`--memory -1GiB`) is a value, which its option's type
    refuses by name, not an unknown option ("expected one argument")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse reads only plain negative numbers as values; no option of ours is "-<digit>".
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


# No GPU has less: a smaller size is a unit forgotten (`--memory 1` would be one byte).
MIN_MEMORY_BYTES = 2**20


def memory_size(text: str) -> int:
    """A memory size such as `2GiB`, `1500MiB` or a byte count, of at least 1 MiB (argparse
    type)."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"memory size must be positive: {text!r}")
    try:
        size_bytes = parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if size_bytes < MIN_MEMORY_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {size_bytes} bytes, less than 1 MiB: give a unit (e.g. 1GiB, 1500MiB)"
        )
    return size_bytes


def gpu_name(text: str) -> str:
    """A catalogue GPU name or alias (`H100 80GB`, `h100-80gb`), as its canonical name
    (argparse type)."""
    try:
        return find_gpu(text).name
    except UnknownGpu as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}: {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}: {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
port_number = int_at_least(0, 65535)


# `--processes auto`: as many as may help (`side_by_side_processes`).
AUTO_PROCESSES = 0


def processes_count(text: str) -> int:
    """`auto` (as `AUTO_PROCESSES`) or a count of at least 1 (argparse type)."""
    if text.strip().lower() == "auto":
        return AUTO_PROCESSES
    return positive_int(text)


def side_by_side_processes(layouts: int) -> int:
    """What `--processes auto` means for an estimate of `layouts` layouts: one process per
    core this process may run on, up to the layouts, on Linux; one elsewhere, where a child
    forked from a process that loaded torch is not safe (macOS's system libraries)."""
    if not sys.platform.startswith("linux"):
        return 1
    return max(1, min(layouts, len(os.sched_getaffinity(0))))


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None


def positive_seconds(text: str) -> float:
    value = _seconds(text)
    if not value > 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def non_negative_seconds(text: str) -> float:
    value = _seconds(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


DEVICE_HELP = (
    "cuda, cuda:N, or cpu (an emulated GPU; needs --memory or --gpu). "
    "Default: cpu with --gpu, else cuda when present, else cpu."
)


def add_device_args(
    parser: argparse.ArgumentParser, *, estimate: bool = False, device_help: str = DEVICE_HELP
) -> None:
    """`--device`, and `--memory` or `--gpu` (one of them); `open_device(args)` opens them.
    `estimate`: also `--estimate NAME`, one of the three (`open_runner(args, spec)`)."""
    parser.add_argument("--device", default=None, help=device_help)
    # One or the other: a named GPU's capacity is the card's less what CUDA takes on it, and a
    # --memory on top would make a device that is neither (docs/design.md#the-interface).
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--memory",
        type=memory_size,
        default=None,
        metavar="SIZE",
        help="capacity of the emulated GPU (e.g. 2GiB, 1500MiB); caps a real GPU's capacity",
    )
    size.add_argument(
        "--gpu",
        type=gpu_name,
        default=None,
        metavar="NAME",
        help='emulate a named GPU (e.g. "H100 80GB", "A100 40GB", "T4"): its memory less what '
        "CUDA takes on it",
    )
    if estimate:
        size.add_argument(
            "--estimate",
            type=gpu_name,
            default=None,
            metavar="NAME",
            help="estimate for a named GPU without running the step: traced on fake tensors "
            "(any model size, seconds), speed by roofline",
        )


def open_device(
    args: argparse.Namespace,
    *,
    world_size: int = 1,
    allocator_config: AllocatorConfig | None = None,
) -> Device:
    """The device of `--device` / `--memory` / `--gpu` ("cpu" with `--gpu`; otherwise "cuda"
    when present and no `--device` was given, else "cpu"). `world_size` is the spec's: a named
    GPU's capacity depends on it (NCCL's buffers). `allocator_config`: the caching allocator's
    settings (default: this process's environment's).

    Raises:
        SpecError: the emulated cpu device without `--memory` or `--gpu`, `--gpu` with a CUDA
            device, or an unknown device name.
        DeviceError: CUDA was asked for and is unavailable.
    """
    import torch

    from autotune.engine.devices.device import open_device as open_named_device

    name: str | None = args.device
    if name is None:
        name = "cpu" if args.gpu is not None or not torch.cuda.is_available() else "cuda"
    return open_named_device(
        name,
        args.memory,
        gpu=args.gpu,
        world_size=world_size,
        allocator_config=allocator_config or allocator_config_from_environment(),
    )


def open_runner(args: argparse.Namespace, spec: Spec) -> TrialRunner:
    """Where `probe` and `tune` run the spec's trials: an estimate for `--estimate NAME` (on fake
    tensors, nothing executed), else the device of `open_device(args)`.

    Raises:
        SpecError: `--estimate` with `--device` other than cpu; as `open_device`.
        DeviceError: as `open_device`.
    """
    from autotune.engine.runner import InProcessRunner

    world_size = spec.training.world_size
    named = getattr(args, "estimate", None) or getattr(args, "gpu", None)
    if named is not None and (problem := box_problem(spec.training, find_gpu(named))):
        raise SpecError(problem)
    if getattr(args, "estimate", None) is None:
        return InProcessRunner(spec, open_device(args, world_size=world_size))
    if args.device not in (None, "cpu"):
        raise SpecError(
            f"--estimate: traces the step without a device; --device {args.device} is not used"
        )
    from autotune.engine.estimate import EstimateRunner

    budget = budget_for(find_gpu(args.estimate), world_size)
    return EstimateRunner(spec, gpu=budget, allocator_config=allocator_config_from_environment())


def capacity_text(info: DeviceInfo) -> str:
    """The device's capacity as a command opens it. A CUDA device's is provisional until its
    first step has loaded CUDA's kernels and library handles (hundreds of MB on a large card,
    `CudaDevice`): the result states the final one."""
    from autotune.core.bytesize import format_bytes
    from autotune.core.schemas import DeviceKind

    capacity = format_bytes(info.capacity_bytes)
    if info.kind is DeviceKind.CUDA:
        return f"{capacity} free before the first step; read again once it has run"
    return f"capacity {capacity}"


NO_TRACE_HELP = (
    "run the search's first fit points as real trials instead of tracing the step on fake "
    "tensors first (a right trace leaves two real trials per mode)"
)


def add_trace_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-trace", action="store_true", help=NO_TRACE_HELP)


def fit_tracer(args: argparse.Namespace, runner: TrialRunner) -> FitTracer | None:
    """The probe's tracer of `open_runner`'s runner: none for an estimate, whose trials are
    traces already, nor with `--no-trace`."""
    if args.no_trace or getattr(args, "estimate", None) is not None:
        return None
    from autotune.engine.fit_points import TracedFitPoints

    return TracedFitPoints(runner)


NO_EXPANDABLE_SEGMENTS_HELP = (
    "do not also evaluate each mode under PYTORCH_ALLOC_CONF=expandable_segments:True (traced, "
    "then verified by real trials only when the trace predicts a larger answer or no sizes "
    "running out); nothing is evaluated when your settings have them already"
)


def add_expandable_segments_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-expandable-segments", action="store_true", help=NO_EXPANDABLE_SEGMENTS_HELP
    )


def expandable_segments(
    args: argparse.Namespace, spec: Spec, info: DeviceInfo
) -> ExpandableSegments | None:
    """The probe's second session, on the device of `open_device(args)` with expandable
    segments added to its allocator settings (`info`: the first session's device), and its
    tracer. None with `--no-expandable-segments`, when the settings have them already, for an
    estimate, and on a CUDA device: this process's CUDA read its settings once, as it started
    (a worker's trial children, each a fresh process, evaluate them there)."""
    if args.no_expandable_segments or getattr(args, "estimate", None) is not None:
        return None
    from autotune.core.schemas import DeviceKind
    from autotune.engine.probe import ExpandableSegments, with_expandable_segments

    conf = with_expandable_segments(info)
    if conf is None or info.kind is not DeviceKind.EMULATED:
        return None
    from autotune.core.memory.allocator_config import parse_alloc_conf
    from autotune.engine.fit_points import TracedFitPoints
    from autotune.engine.runner import InProcessRunner

    device = open_device(
        args, world_size=spec.training.world_size, allocator_config=parse_alloc_conf(conf)
    )
    session = InProcessRunner(spec, device)
    return ExpandableSegments(session, TracedFitPoints(session))


def allocator_config_from_environment() -> AllocatorConfig:
    """The caching allocator's settings torch reads from this process's environment.

    Raises:
        SpecError: `PYTORCH_ALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF` is not one torch accepts.
    """
    try:
        return config_from_environ(os.environ)
    except AllocatorConfigError as error:
        raise SpecError(str(error)) from None


def add_server_args(parser: argparse.ArgumentParser, *, token_help: str) -> None:
    """`--server` (default AUTOTUNE_SERVER, else the local server) and `--token`."""
    parser.add_argument(
        "--server",
        default=os.environ.get(ENV_SERVER_URL, DEFAULT_SERVER_URL),
        help=f"server URL (default: {ENV_SERVER_URL} or {DEFAULT_SERVER_URL})",
    )
    parser.add_argument(
        "--token", default=os.environ.get(ENV_TOKEN), help=f"{token_help} (default: {ENV_TOKEN})"
    )
