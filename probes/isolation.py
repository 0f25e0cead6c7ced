"""Trial isolation: every trial of a run in a fresh child process, with a time limit.

Importing this module does not import torch (the CLI registers `autotune worker` from it);
the children do, and so does the worker once it tunes.

`ChildProcessRunner` is the worker's `autotune.engine.runner.TrialRunner`. Each of its calls starts
a new `spawn` process that builds a `InProcessRunner` (model, optimizer, device) from the spec,
warms it up so that the trial runs in steady state (optimizer state allocated, as in one long-lived
session), runs the one trial or measurement and sends the result back through a pipe. So an
out-of-memory that leaves the allocator fragmented, a wedged CUDA context, a segfault or a hang in
one trial can never reach the worker or the next trial.

What comes back:
* a result: out-of-memory is still `fits=False` (or a None measurement), decided in the child
  by `autotune.engine.devices.device` as in one process;
* an exception raised in the child: autotune's own errors as themselves, anything else as
  `TrialError` with the child's type name, message and traceback;
* no answer (death by a signal, an exit without answering, the time limit): `TrialCrashed`.

No process of a trial outlives the worker, however the worker dies. The child runs in its own
process group, so that killing the group kills whatever it started (the worker does so on a
time limit or an interrupt). It asks the kernel for SIGKILL when its parent dies (Linux
PR_SET_PDEATHSIG), watches its parent from a thread as well, and ignores SIGINT (Ctrl-C in a
terminal reaches the whole process group; the worker decides what happens to a trial). The
kernel's signal takes the child only, not what the child started (a `sleep` in a model's
forward would be re-parented to init): so the child first forks a reaper into its group, which
SIGKILLs the whole group once the child or the worker is gone.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Literal

from autotune.core.errors import AutotuneError
from autotune.core.memory.allocator_config import AllocatorConfig, parse_alloc_conf
from autotune.core.schemas import DeviceInfo, DeviceKind, Spec, StepOutcome
from autotune.core.tuning.throughput import Measurement
from probes.errors import TrialCrashed, TrialError

if TYPE_CHECKING:
    from autotune.engine.devices.cuda_runtime import CudaRuntime

logger = logging.getLogger(__name__)

Operation = Literal["devices", "describe", "warm_up", "trial", "measure"]
Interrupt = Callable[[], None]
"""Called while a child runs; raises to stop the run now (the child is killed first)."""

StartMethod = Literal["spawn", "forkserver"]
START_METHODS: tuple[StartMethod, ...] = ("spawn", "forkserver")
# What a forkserver imports once, so that its children start in milliseconds instead of
# seconds (torch, and torch._dynamo, which the first optimizer built imports: 2 s each).
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "autotune.engine.runner", "probes.isolation"]

DEFAULT_TIMEOUT_S = 600.0
# A child's start (a new interpreter importing torch, or the first fork of a forkserver that
# imports it) is not the trial's time: it took 2-6 s, and over 20 s on a loaded machine, for
# any model. The trial's limit runs from the child's "started" message; this bounds the start.
STARTUP_TIMEOUT_S = 300.0
# A child that answered but does not exit (e.g. stuck tearing down a CUDA context) is killed
# after this long; its answer stands.
EXIT_GRACE_S = 10.0
_POLL_S = 0.05
_PARENT_WATCH_S = 0.5
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class ChildRequest:
    """What one child process does. `warm_mode` is the checkpointing mode to warm up in before
    a trial or measurement (None: no warm-up, as in a session that never warmed up).
    `worker_pid` is the worker's process id; `spawned` says whether it is the parent too.
    `allowed_factories`: the worker's `--allow-factory` prefixes; a factory outside them is
    refused in the child too, before anything is imported (`autotune.core.factoryaccess`).
    `allocator_conf`: the caching allocator's settings (`PYTORCH_ALLOC_CONF`'s text), which
    the child's CUDA starts with and its emulated GPU models (None: torch's defaults); the
    worker read its own once, as it started, and passes them or others down.
    `simulated_gpu`: a cuda device runs on the simulated CUDA backend of this catalogue GPU
    (`autotune.engine.devices.simulated_cuda`), where no card is."""

    operation: Operation
    device_name: str
    memory_bytes: int | None
    worker_pid: int
    gpu: str | None = None
    spawned: bool = True
    spec_json: str = ""
    warm_mode: bool | None = None
    micro_batch: int = 1
    accumulation_steps: int = 1
    checkpointing: bool = False
    checkpointed_blocks: int | None = None
    target_seconds: float = 1.0
    log_level: int = logging.WARNING
    allowed_factories: tuple[str, ...] = ()
    trace_fit: bool = False
    allocator_conf: str | None = None
    simulated_gpu: str | None = None


@dataclass(frozen=True)
class Description:
    """What the tuner asks of a runner before any trial; with `trace_fit`, also each mode's
    traced fit points (`autotune.engine.fit_points`), made in the same child."""

    device_info: DeviceInfo
    supports_checkpointing: bool
    tokens_per_sample: int | None
    fit_points: dict[bool, list[StepOutcome]] = field(default_factory=dict)
    num_blocks: int | None = None


@dataclass(frozen=True)
class FailedCall:
    """A runner call whose child crashed or raised: which call, with what, and the error."""

    operation: Operation
    micro_batch: int
    accumulation_steps: int
    checkpointing: bool
    error: TrialCrashed | TrialError


# ---------------------------------------------------------------------------------------------
# The child side.


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, under another user (a reused pid; rare enough)
        return True
    return True


def _watch_parent(parent_pid: int, worker_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid or not _is_alive(worker_pid):
            os._exit(1)  # orphaned: nobody will read the answer
        time.sleep(_PARENT_WATCH_S)


def _start_group_reaper(worker_pid: int) -> None:
    """Forks the group's reaper (see the module docstring); returns in the child at once."""
    child_pid = os.getpid()
    if os.fork() != 0:
        return
    try:
        # Hold no pipe end: the worker must see EOF when the child dies.
        os.closerange(3, 1 << 16)
        while os.getppid() == child_pid and _is_alive(worker_pid):
            time.sleep(_PARENT_WATCH_S)
        os.killpg(0, signal.SIGKILL)  # the reaper is in the group: it ends here too
    finally:
        os._exit(0)


def _become_expendable(worker_pid: int, spawned: bool) -> None:
    """Tie this child's life to the worker's; see the module docstring. A spawned child's
    parent is the worker; a forkserver's child's parent is the forkserver, which exits when
    the worker does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = os.getppid()
    try:
        os.setpgid(0, 0)
    except OSError:  # already a group leader, or not permitted: the pid kill still works
        pass
    if os.getpgid(0) == os.getpid():  # never reap a group that is not the trial's own
        _start_group_reaper(worker_pid)
    if sys.platform == "linux":
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    # The worker may have died before prctl took effect (and we were re-parented already);
    # the thread covers other platforms, but not a child stuck holding the GIL.
    if (spawned and parent_pid != worker_pid) or not _is_alive(worker_pid):
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid, worker_pid), daemon=True).start()


def _open_devices(
    device_name: str, memory_bytes: int | None, allocator_config: AllocatorConfig
) -> list[DeviceInfo]:
    """ "cuda" is every visible GPU; anything else the one device it names."""
    from autotune.engine.devices.device import open_device

    if device_name == "cuda":
        import torch

        count = torch.cuda.device_count()
        if count > 0:
            return [
                open_device(f"cuda:{i}", memory_bytes, allocator_config=allocator_config).info
                for i in range(count)
            ]
    return [open_device(device_name, memory_bytes, allocator_config=allocator_config).info]


def use_allocator_conf(conf: str | None, environ: MutableMapping[str, str]) -> None:
    """Give a child's CUDA the allocator settings `conf` (None: torch's defaults), whatever it
    inherited from the worker's environment. torch reads them once, when CUDA starts (its
    first tensor on the card), so this runs before anything in the child can touch CUDA.
    `PYTORCH_CUDA_ALLOC_CONF` would win over `PYTORCH_ALLOC_CONF`
    (`autotune.core.memory.allocator_config.config_from_environ`), so it goes."""
    environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf is None:
        environ.pop("PYTORCH_ALLOC_CONF", None)
    else:
        environ["PYTORCH_ALLOC_CONF"] = conf


def _allocator_config(request: ChildRequest) -> AllocatorConfig:
    """The settings the request gives the child, parsed (the worker checked them)."""
    conf = request.allocator_conf
    return AllocatorConfig() if conf is None else parse_alloc_conf(conf)


def _perform(request: ChildRequest) -> object:
    if request.operation == "devices":
        return _open_devices(request.device_name, request.memory_bytes, _allocator_config(request))
    if request.simulated_gpu is None:
        return _perform_on(request, None)
    from autotune.core.gpus.catalogue import find_gpu
    from autotune.engine.devices.simulated_cuda import SimulatedCuda

    # It reads the allocator's settings from the environment as CUDA starts, as torch does:
    # those `use_allocator_conf` put there.
    with SimulatedCuda(find_gpu(request.simulated_gpu), environ=os.environ) as cuda:
        return _perform_on(request, cuda)


def _perform_on(request: ChildRequest, cuda: CudaRuntime | None) -> object:
    from autotune.engine.devices.device import open_device
    from autotune.engine.emulation.gpu_speed import timed_on_its_gpu
    from autotune.engine.runner import InProcessRunner

    spec = Spec.model_validate_json(request.spec_json)
    # A named GPU's capacity is one rank's of the spec's world size (NCCL's buffers).
    device = open_device(
        request.device_name,
        request.memory_bytes,
        gpu=request.gpu,
        world_size=spec.training.world_size,
        # What the child's CUDA started with (`use_allocator_conf`).
        allocator_config=_allocator_config(request),
        cuda=cuda,
    )
    session = InProcessRunner(
        spec,
        device,
        allowed_factory_prefixes=request.allowed_factories,
        # One operation, then the process exits: nothing to undo, so no host copy of the state.
        keeps_state=False,
    )
    if request.operation == "describe":
        if device.info.kind is DeviceKind.CUDA:
            # A CUDA device's capacity is final once a step's kernels are loaded (kernels
            # and library handles take memory on first use); the trials' children warm up too.
            session.warm_up(checkpointing=False)
        # Tuning on an emulated named GPU, samples/s are its roofline's, and its device says so
        # (a probe alone measures no speed).
        described = (
            timed_on_its_gpu(session, allowed_factory_prefixes=request.allowed_factories)
            if spec.training.target_global_batch is not None
            else session
        )
        fit_points: dict[bool, list[StepOutcome]] = {}
        if request.trace_fit:
            from autotune.engine.fit_points import trace_fit_points

            fit_points = trace_fit_points(
                spec,
                session.device_info,
                modes=[False, True] if session.supports_checkpointing else [False],
                allowed_factory_prefixes=request.allowed_factories,
            )
        return Description(
            device_info=described.device_info,
            supports_checkpointing=session.supports_checkpointing,
            tokens_per_sample=session.tokens_per_sample,
            fit_points=fit_points,
            num_blocks=session.num_blocks,
        )
    if request.operation == "warm_up":
        return session.warm_up(checkpointing=request.checkpointing)
    if request.warm_mode is not None:
        session.warm_up(checkpointing=request.warm_mode)
    if request.operation == "trial":
        return session.trial(
            request.micro_batch,
            request.accumulation_steps,
            checkpointing=request.checkpointing,
            checkpointed_blocks=request.checkpointed_blocks,
        )
    measured = timed_on_its_gpu(session, allowed_factory_prefixes=request.allowed_factories)
    return measured.measure(
        request.micro_batch,
        request.accumulation_steps,
        checkpointing=request.checkpointing,
        target_seconds=request.target_seconds,
        checkpointed_blocks=request.checkpointed_blocks,
    )


def child_main(connection: Connection, request: ChildRequest) -> None:
    """Entry point of a child process: perform `request`, send ("ok", result) or ("error",
    module, class name, message, traceback)."""
    _become_expendable(request.worker_pid, request.spawned)
    use_allocator_conf(request.allocator_conf, os.environ)
    logging.basicConfig(
        level=request.log_level, format="%(levelname)s %(name)s (trial child): %(message)s"
    )
    for module in FORKSERVER_PRELOAD:  # already imported in a forkserver's child
        importlib.import_module(module)
    connection.send(("started",))
    message: tuple[Any, ...]
    try:
        message = ("ok", _perform(request))
    except BaseException as error:  # the parent decides; a child has nothing to protect
        kind = type(error)
        message = ("error", kind.__module__, kind.__qualname__, str(error), traceback.format_exc())
    try:
        connection.send(message)
    except Exception as error:  # an answer that does not pickle is a bug worth seeing
        connection.send(
            ("error", type(error).__module__, type(error).__qualname__, str(error), "")
        )
    connection.close()


# ---------------------------------------------------------------------------------------------
# The parent side.


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not finish"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode} without an answer"


def _kill(process: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL the child's process group (whatever it started too), then the child."""
    pid = process.pid
    if pid is not None:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if process.is_alive():
        process.kill()
    process.join()


def _rebuild_error(module: str, qualname: str, message: str, child_traceback: str) -> Exception:
    """autotune's (and the worker's) own errors come back as themselves, anything else as a
    TrialError naming the child's exception."""
    if module.startswith(("autotune.", "probes.")) and "." not in qualname:
        try:
            kind = getattr(importlib.import_module(module), qualname)
            if isinstance(kind, type) and issubclass(kind, AutotuneError):
                rebuilt = kind(message)
                assert isinstance(rebuilt, Exception)
                return rebuilt
        except (ImportError, AttributeError, TypeError):
            pass
    return TrialError(qualname, message, child_traceback)


def _describe_request(request: ChildRequest) -> dict[str, Any]:
    if request.operation in ("devices", "describe"):
        return {}
    return {
        "micro_batch": request.micro_batch,
        "accumulation_steps": request.accumulation_steps,
        "checkpointing": request.checkpointing,
        "checkpointed_blocks": request.checkpointed_blocks,
    }


def _context(
    start_method: StartMethod,
) -> multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext:
    if start_method == "spawn":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # Only read when the forkserver starts (the first child); harmless afterwards.
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


def run_child(
    request: ChildRequest,
    *,
    timeout_s: float,
    interrupt: Interrupt | None = None,
    start_method: StartMethod = "spawn",
) -> object:
    """Run `request` in a fresh child process and return its result.

    `spawn` starts a new interpreter per child. `forkserver` forks each child from a server
    process that the worker starts once and that has only imported torch and autotune (it never
    runs a trial, nor touches CUDA): every child is still a new process with nothing of any
    earlier trial, and starts in milliseconds instead of the 2-5 s that importing torch takes.

    Raises:
        TrialCrashed: the child died, exited without answering, did not start within
            `STARTUP_TIMEOUT_S` or ran past `timeout_s` once started (torch imported).
        TrialError: the child raised an exception that is not an AutotuneError.
        AutotuneError: the child raised one (SpecError, ModelBuildError, DeviceError, ...).
        Whatever `interrupt` raises (after the child was killed).
    """
    context = _context(start_method)
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(
        target=child_main,
        args=(writer, request),
        name=f"autotune-{request.operation}",
        daemon=False,  # a daemonic child could not start processes of its own (user code may)
    )
    launched_s = time.monotonic()
    started_s: float | None = None  # when the child said it started
    process.start()
    writer.close()  # so that the reader sees EOF when the child dies
    crash_where = _describe_request(request)
    message: tuple[Any, ...] | None = None
    try:
        while message is None:
            if reader.poll(_POLL_S):
                try:
                    message = reader.recv()
                except EOFError:  # died without answering
                    process.join()
                    raise TrialCrashed(
                        request.operation, _exit_reason(process.exitcode), **crash_where
                    ) from None
                if message == ("started",):
                    started_s, message = time.monotonic(), None
                    continue
                break
            if interrupt is not None:
                interrupt()
            now_s = time.monotonic()
            if started_s is None and now_s - launched_s > STARTUP_TIMEOUT_S:
                raise TrialCrashed(
                    request.operation,
                    f"did not start within {STARTUP_TIMEOUT_S:g} s",
                    **crash_where,
                )
            if started_s is not None and now_s - started_s > timeout_s:
                raise TrialCrashed(
                    request.operation, f"timed out after {timeout_s:g} s", **crash_where
                )
        process.join(EXIT_GRACE_S)
        if process.is_alive():
            logger.warning(
                "%s child %s answered but did not exit; killed", request.operation, process.pid
            )
        elif process.exitcode != 0:
            # The answer stands (it was whole when sent), but a process that dies on its way
            # out (a corrupted heap aborting at exit) has a bug that may have touched it.
            logger.warning(
                "%s child %s answered, then %s; its answer stands",
                request.operation,
                process.pid,
                _exit_reason(process.exitcode).removesuffix(" without an answer"),
            )
    finally:
        reader.close()
        if process.is_alive():
            _kill(process)
        process.close()
    logger.debug(
        "%s %s in a child: %.2f s", request.operation, crash_where, time.monotonic() - launched_s
    )
    if message[0] == "ok":
        return message[1]
    _, module, qualname, text, child_traceback = message
    raise _rebuild_error(module, qualname, text, child_traceback)


def read_devices(
    device_name: str,
    memory_bytes: int | None,
    *,
    timeout_s: float,
    allocator_conf: str | None = None,
) -> list[DeviceInfo]:
    """The devices "cpu" (emulated; needs `memory_bytes`), "cuda" (every visible GPU) or
    "cuda:N" would run on, read in a child process: a CUDA context created to read a GPU's
    free memory must not live on in the worker, where it would take memory from every trial.
    `allocator_conf`: the allocator settings the child's CUDA starts with (None: the defaults).

    Raises:
        SpecError, DeviceError: as `autotune.engine.devices.device.open_device`.
    """
    request = ChildRequest(
        operation="devices",
        device_name=device_name,
        memory_bytes=memory_bytes,
        worker_pid=os.getpid(),
        allocator_conf=allocator_conf,
    )
    # Always spawned: a forkserver started now would outlive the need for it.
    devices = run_child(request, timeout_s=timeout_s)
    assert isinstance(devices, list)
    return devices


class ChildProcessRunner:
    """A `TrialRunner` whose every call runs in a fresh child process.

    Args:
        spec: What to train.
        device_name: "cpu" (emulated) or "cuda:N"; as `autotune.engine.devices.device.open_device`.
        memory_bytes: The emulated capacity, or a cap on a GPU's.
        gpu: The named GPU the cpu device emulates (instead of `memory_bytes`).
        timeout_s: Time limit of one child once started (model build, warm-up and the trial;
            not the interpreter's start and torch's import, see `STARTUP_TIMEOUT_S`).
        interrupt: Checked while children run; whatever it raises stops the run.
        start_method: "spawn" or "forkserver" (see `run_child`).
        allowed_factories: module prefixes whose factories the children may import (the
            worker's `--allow-factory`); by default none.
        trace_fit: the first child (`describe`) also traces the step at the search's fit
            points, which `fit_points` gives the probe (a `FitTracer`).
        allocator_conf: the allocator settings (`PYTORCH_ALLOC_CONF`'s text) every child's
            CUDA starts with and its emulated GPU models (None: torch's defaults).
        simulated_gpu: run "cuda" devices on the simulated CUDA backend of this catalogue GPU.
    """

    def __init__(
        self,
        spec: Spec,
        device_name: str,
        memory_bytes: int | None,
        *,
        gpu: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        interrupt: Interrupt | None = None,
        start_method: StartMethod = "spawn",
        allowed_factories: tuple[str, ...] = (),
        trace_fit: bool = False,
        allocator_conf: str | None = None,
        simulated_gpu: str | None = None,
    ) -> None:
        self.spec = spec
        self.allocator_conf = allocator_conf
        self.simulated_gpu = simulated_gpu
        self.trace_fit = trace_fit
        self.start_method = start_method
        self.allowed_factories = allowed_factories
        self.device_name = device_name
        self.memory_bytes = memory_bytes
        self.gpu = gpu
        self.timeout_s = timeout_s
        self.interrupt = interrupt
        self.children_run = 0
        self.last_failure: FailedCall | None = None
        self._spec_json = spec.model_dump_json()
        self._description: Description | None = None
        # The mode of the first warm-up that fitted: every later child warms up the same way, so
        # that its trial sees the optimizer state, and the residents where that warm-up left
        # them, as a long-lived session would (a later warm-up finds them placed).
        self._warm_mode: bool | None = None

    def check_stop(self) -> None:
        if self.interrupt is not None:
            self.interrupt()

    def _run(self, operation: Operation, **fields: Any) -> object:
        self.check_stop()
        request = ChildRequest(
            operation=operation,
            device_name=self.device_name,
            memory_bytes=self.memory_bytes,
            gpu=self.gpu,
            worker_pid=os.getpid(),
            spawned=self.start_method == "spawn",
            spec_json=self._spec_json,
            warm_mode=self._warm_mode,
            log_level=logging.getLogger("autotune").getEffectiveLevel(),
            allowed_factories=self.allowed_factories,
            trace_fit=self.trace_fit,
            allocator_conf=self.allocator_conf,
            simulated_gpu=self.simulated_gpu,
            **fields,
        )
        self.children_run += 1
        try:
            return run_child(
                request,
                timeout_s=self.timeout_s,
                interrupt=self.interrupt,
                start_method=self.start_method,
            )
        except (TrialCrashed, TrialError) as error:
            self.last_failure = FailedCall(
                operation,
                request.micro_batch,
                request.accumulation_steps,
                request.checkpointing,
                error,
            )
            raise

    def describe(self) -> Description:
        """The device, and what the model supports; one child, the first time only."""
        if self._description is None:
            description = self._run("describe")
            assert isinstance(description, Description)
            self._description = description
        return self._description

    @property
    def device_info(self) -> DeviceInfo:
        return self.describe().device_info

    def fit_points(self, *, checkpointing: bool) -> list[StepOutcome]:
        """The traced fit points of the first child (none without `trace_fit`)."""
        return self.describe().fit_points.get(checkpointing, [])

    @property
    def supports_checkpointing(self) -> bool:
        return self.describe().supports_checkpointing

    @property
    def num_blocks(self) -> int | None:
        return self.describe().num_blocks

    @property
    def tokens_per_sample(self) -> int | None:
        return self.describe().tokens_per_sample

    def warm_up(self, *, checkpointing: bool) -> StepOutcome:
        outcome = self._run("warm_up", checkpointing=checkpointing)
        assert isinstance(outcome, StepOutcome)
        if outcome.fits and self._warm_mode is None:
            self._warm_mode = checkpointing
        return outcome

    def trial(
        self,
        micro_batch: int,
        accumulation_steps: int = 1,
        *,
        checkpointing: bool,
        checkpointed_blocks: int | None = None,
    ) -> StepOutcome:
        outcome = self._run(
            "trial",
            micro_batch=micro_batch,
            accumulation_steps=accumulation_steps,
            checkpointing=checkpointing,
            checkpointed_blocks=checkpointed_blocks,
        )
        assert isinstance(outcome, StepOutcome)
        return outcome

    def measure(
        self,
        micro_batch: int,
        accumulation_steps: int,
        *,
        checkpointing: bool,
        target_seconds: float,
        checkpointed_blocks: int | None = None,
    ) -> Measurement | None:
        measurement = self._run(
            "measure",
            micro_batch=micro_batch,
            accumulation_steps=accumulation_steps,
            checkpointing=checkpointing,
            target_seconds=target_seconds,
            checkpointed_blocks=checkpointed_blocks,
        )
        assert measurement is None or isinstance(measurement, Measurement)
        return measurement
