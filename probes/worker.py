"""The probe worker: claim runs from the server, tune each with every trial in a child process,
stream progress, report the result or the failure.

    worker = Worker(client, read_inventory("cpu", 4 * 2**30), WorkerConfig(...))
    worker.install_signal_handlers()
    worker.run_forever()

One run at a time. Around each run is the worker's one catch-all boundary: whatever goes wrong
in a run (a crashed or hung trial, a bug in the user's model, an unexpected error) is reported
to the server with its type, message and traceback tail, and the worker takes the next run.

* Lease: a heartbeat thread renews it every `heartbeat_interval_s` (a third of the lease), and
  goes on through a server outage (a transport error is retried, never fatal). When the server
  answers that the lease is stale or the run was cancelled, the run stops at once (its current
  trial is killed) and nothing more is sent for it. A lease that lapsed while the server was
  away is renewed by the next heartbeat unless another worker claimed the run meanwhile; a post
  refused as `lease_expired` sends a heartbeat at once and, if it renewed, is sent again once.
* Progress: probe attempts and trials are posted as they finish. A post that fails because the
  server is unreachable is skipped: the final result carries everything.
* Failures: errors that come from the spec (a model that cannot be built, a trial that crashes,
  hangs or raises in user code) are reported as not retryable; they would recur on any worker.
  Anything else is retryable, and the server requeues the run until its claim limit. So is a
  factory this worker refuses (`WorkerConfig.allowed_factories`, `--allow-factory`): refused
  before any child starts, with nothing imported; a worker that allows it may take the run.
  A trial that crashes during a throughput measurement is also posted as a FAILED trial; the
  run then fails (the Optuna study cannot continue past an objective that raised).
* Shutdown (SIGTERM, Ctrl-C): no new claims; a run in progress gets `shutdown_grace_s` to
  finish, else its trial is killed and the run is released (a retryable failure, "worker
  shutting down"). A second signal stops at once.
* Server down: the claim loop waits with capped exponential backoff and logs each change of
  state once; the final result and failure reports are retried until the server answers (the
  lease stays renewable while nobody else claims the run) or the worker is told to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import TypeVar

from autotune.core.bytesize import format_bytes
from autotune.core.defaults import ESTIMATE_MEMORY_LIMIT_BYTES, ESTIMATE_TIME_LIMIT_S
from autotune.core.errors import FactoryRefused, ModelBuildError, SpecError
from autotune.core.factoryaccess import check_factory_allowed
from autotune.core.memory.allocator_config import AllocatorConfig, settings_text
from autotune.core.schemas import Sharding, Spec, StepOutcome, Trial, TrialState, TuneResult
from autotune.engine.probe import (
    ExpandableSegments,
    FitTracer,
    probe_session,
    with_expandable_segments,
)
from autotune.engine.remedy_trials import fits_nowhere, with_fit_advice
from autotune.engine.runner import TrialRunner
from autotune.engine.tuner import tune_session
from autotune.remote.client import (
    LeaseExpired,
    LeaseLost,
    RequestRejected,
    ServerClient,
    ServerError,
    ServerUnavailable,
)
from autotune.remote.protocol import Claim
from probes.errors import EstimateLimitExceeded, TrialCrashed, TrialError, WorkerShutdown
from probes.inventory import ESTIMATE_DEVICE, WorkerDevice
from probes.isolation import DEFAULT_TIMEOUT_S, ChildProcessRunner, StartMethod

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that the spec causes: another claim, on any worker, would end the same way.
_SPEC_ERRORS = (SpecError, ModelBuildError, TrialCrashed, TrialError)
_TRACEBACK_CHARS = 4000
_SLEEP_SLICE_S = 0.1
SHUTDOWN_REASON = "worker shutting down"
# Streamed trial numbers of sharding: auto's n-th layout start at n x this (`_Progress`).
LAYOUT_TRIAL_STRIDE = 10_000


class RunOutcome(StrEnum):
    SUCCEEDED = "succeeded"  # the result was accepted
    FAILED = "failed"  # reported as a failure
    RELEASED = "released"  # handed back on shutdown
    LOST = "lost"  # the lease went stale or the run was cancelled


@dataclass(frozen=True)
class WorkerConfig:
    """How the worker behaves; every field has a CLI option (`autotune worker --help`)."""

    worker_id: str
    storage_url: str
    trial_timeout_s: float = DEFAULT_TIMEOUT_S
    poll_interval_s: float = 5.0
    max_backoff_s: float = 60.0
    seconds_per_trial: float = 1.0
    shutdown_grace_s: float = 10.0
    start_method: StartMethod = "spawn"
    # Module prefixes whose factory specs this worker may import (`autotune.core.factoryaccess`).
    allowed_factories: tuple[str, ...] = ()
    # Trace each mode's first fit points instead of running them (`autotune.engine.fit_points`).
    trace_fit: bool = True
    # Also evaluate each mode under expandable segments, in trial children of their own
    # (`autotune.engine.probe.ExpandableSegments`), unless the worker's settings have them.
    expandable_segments: bool = True
    # Per estimate run (traced in this process): its time, and how much it may grow this
    # process's resident memory; past either it fails (`EstimateLimitExceeded`).
    estimate_time_limit_s: float = ESTIMATE_TIME_LIMIT_S
    estimate_memory_limit_bytes: int = ESTIMATE_MEMORY_LIMIT_BYTES
    # The caching allocator's settings this worker started with (`PYTORCH_ALLOC_CONF`, read
    # once by its entry point): its trial children's CUDA starts with them, and its emulated
    # GPUs and estimates model them.
    allocator_config: AllocatorConfig = AllocatorConfig()


class _LeaseKeeper:
    """Renews a claim's lease from a thread; remembers a refusal for the main thread."""

    def __init__(self, client: ServerClient, claim: Claim) -> None:
        self.client = client
        self.claim = claim
        self.interval_s = claim.heartbeat_interval_s
        self.lost: LeaseLost | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name=f"heartbeat-run-{claim.run_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.renew()
            except LeaseLost:
                return
            except ServerError as error:  # keep trying: the lease may still be ours
                logger.warning("run %d: heartbeat failed: %s", self.claim.run_id, error)

    def renew(self) -> None:
        """One heartbeat now. A lease that lapsed while the server was away comes back, unless
        another worker claimed the run since.

        Raises:
            LeaseLost: refused (remembered for `check`).
            ServerError: no answer.
        """
        try:
            self.client.heartbeat(self.claim.run_id, self.claim.lease_id)
        except RequestRejected as error:  # 409 stale/cancelled, or 404: the run is gone
            logger.warning("run %d: heartbeat refused: %s", self.claim.run_id, error)
            lost = (
                error
                if isinstance(error, LeaseLost) and not isinstance(error, LeaseExpired)
                else LeaseLost(error.status_code, error.code, error.detail)
            )
            self.lost = lost
            raise lost from None

    def call(self, post: Callable[[], T]) -> T:
        """`post()` under this lease: refused as lapsed, it is sent again once after a
        heartbeat renewed the lease.

        Raises:
            LeaseLost: the lease could not be renewed, or the post was refused again.
        """
        try:
            return post()
        except LeaseExpired as expired:
            logger.warning("run %d: %s; renewing the lease", self.claim.run_id, expired)
        self.renew()
        logger.warning("run %d: lease renewed; sending again", self.claim.run_id)
        return post()

    def check(self) -> None:
        """Raises LeaseLost once the server refused a heartbeat."""
        lost = self.lost
        if lost is not None:
            raise LeaseLost(lost.status_code, lost.code, lost.detail)


class _Progress:
    """Streams a run's attempts and trials to the server as they finish."""

    def __init__(self, client: ServerClient, keeper: _LeaseKeeper) -> None:
        self.client = client
        self.keeper = keeper
        self.claim = keeper.claim
        self.sequence = 0
        self.trial_numbers: list[int] = []
        # sharding: auto tunes one study per layout, each numbering its trials from 0: the
        # streamed numbers of the n-th layout start at n x LAYOUT_TRIAL_STRIDE, so that they
        # stay distinct (the result's trials are the chosen layout's, numbered by its study).
        self.trial_offset = 0

    def layout(self, sharding: Sharding, index: int, count: int) -> None:
        logger.info("run %d: layout %d of %d: %s", self.claim.run_id, index + 1, count, sharding)
        self.trial_offset = index * LAYOUT_TRIAL_STRIDE

    def attempt(self, checkpointing: bool, attempt: StepOutcome) -> None:
        sequence = self.sequence
        self.sequence += 1
        self._post(
            lambda: self.client.post_attempt(
                self.claim.run_id,
                self.claim.lease_id,
                sequence=sequence,
                checkpointing=checkpointing,
                attempt=attempt,
            )
        )

    def trial(self, trial: Trial) -> None:
        if self.trial_offset:
            trial = trial.model_copy(update={"number": trial.number + self.trial_offset})
        self.trial_numbers.append(trial.number)
        self._post(lambda: self.client.post_trial(self.claim.run_id, self.claim.lease_id, trial))

    def _post(self, call: Callable[[], object]) -> None:
        try:
            self.keeper.call(call)
        except ServerUnavailable as error:
            logger.warning(
                "run %d: progress not streamed (%s); the result will carry it",
                self.claim.run_id,
                error,
            )


def _error_type(error: BaseException) -> str:
    return error.error_type if isinstance(error, TrialError) else type(error).__name__


def _error_message(error: BaseException) -> str:
    """The message without the type, which is reported beside it (a TrialError's own text is
    "ValueError: boom"; the failure would read "ValueError: ValueError: boom")."""
    return error.child_message if isinstance(error, TrialError) else str(error)


def _traceback_tail(error: BaseException) -> str:
    if isinstance(error, TrialError) and error.child_traceback:
        text = error.child_traceback
    else:
        text = "".join(traceback.format_exception(error))
    return text[-_TRACEBACK_CHARS:]


class Worker:
    """Claims runs for `devices` and tunes them, one at a time.

    Args:
        client: A worker-token client of the server.
        devices: What this worker offers (`probes.inventory.read_inventory`).
        config: Timeouts, intervals, the Optuna storage.
        heartbeat_client: The client the heartbeat thread uses (default: `client`); give it
            its own so that a slow request of the main thread never delays a heartbeat.
    """

    def __init__(
        self,
        client: ServerClient,
        devices: list[WorkerDevice],
        config: WorkerConfig,
        *,
        heartbeat_client: ServerClient | None = None,
    ) -> None:
        if not devices:
            raise ValueError("a worker needs at least one device")
        self.client = client
        self.heartbeat_client = heartbeat_client or client
        self.devices = devices
        self.config = config
        self._stopping = False
        self._stop_deadline_s: float | None = None
        # Set when a claim could not reach the server; the next claim that does logs so.
        self._unreachable = False

    # -- stopping -------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    def request_stop(self, *, now: bool = False) -> None:
        """Take no more runs; the current one may finish within the grace period (or not at
        all with `now`). Safe to call from a signal handler."""
        grace_s = 0.0 if now or self._stopping else self.config.shutdown_grace_s
        deadline_s = time.monotonic() + grace_s
        if self._stop_deadline_s is None or deadline_s < self._stop_deadline_s:
            self._stop_deadline_s = deadline_s
        self._stopping = True

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the worker (see `request_stop`); a second one, at once."""

        def handle(signum: int, frame: FrameType | None) -> None:
            again = self._stopping
            logger.warning(
                "%s: %s",
                signal.Signals(signum).name,
                "stopping now"
                if again
                else f"stopping; a run in progress gets {self.config.shutdown_grace_s:g} s "
                "to finish (signal again to stop now)",
            )
            self.request_stop(now=again)

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def _sleep(self, seconds: float) -> None:
        """Sleep in short slices, so that a stop request ends the wait."""
        deadline_s = time.monotonic() + seconds
        while not self._stopping and time.monotonic() < deadline_s:
            time.sleep(min(_SLEEP_SLICE_S, max(0.0, deadline_s - time.monotonic())))

    def _interrupt(self, keeper: _LeaseKeeper) -> None:
        """Checked while trials run: raises to stop the run now."""
        keeper.check()
        deadline_s = self._stop_deadline_s
        if deadline_s is not None and time.monotonic() >= deadline_s:
            raise WorkerShutdown(SHUTDOWN_REASON)

    # -- the loop -------------------------------------------------------------------------

    def run_forever(self, *, max_runs: int | None = None) -> list[RunOutcome]:
        """Claim and run until stopped (or `max_runs` runs were done); returns the outcomes.

        Raises:
            AuthError, RequestRejected: the server refuses this worker (a wrong token);
                waiting would not help.
        """
        outcomes: list[RunOutcome] = []
        backoff_s = self.config.poll_interval_s
        logger.info(
            "worker %s: waiting for runs for %s",
            self.config.worker_id,
            ", ".join(d.info.name for d in self.devices),
        )
        while not self._stopping:
            try:
                outcome = self.run_once()
            except ServerUnavailable as error:
                if not self._unreachable:
                    logger.warning("server unreachable (%s); waiting for it", error)
                    self._unreachable = True
                self._sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.config.max_backoff_s)
                continue
            backoff_s = self.config.poll_interval_s
            if outcome is None:
                self._sleep(self.config.poll_interval_s)
                continue
            outcomes.append(outcome)
            if max_runs is not None and len(outcomes) >= max_runs:
                break
        logger.info("worker %s: stopped after %d run(s)", self.config.worker_id, len(outcomes))
        return outcomes

    def run_once(self) -> RunOutcome | None:
        """Claim one run and run it; None when nothing queued matches this worker.

        Raises:
            ServerUnavailable: the claim could not reach the server.
            RequestRejected: the server refused the claim.
        """
        claim = self.client.claim(self.config.worker_id, [d.info for d in self.devices])
        # Said at the first answer, not after the run it may bring (which can take minutes).
        if self._unreachable:
            logger.warning("server reachable again")
            self._unreachable = False
        if claim is None:
            return None
        return self._run_claim(claim)

    # -- one run --------------------------------------------------------------------------

    def _run_claim(self, claim: Claim) -> RunOutcome:
        device = self.devices[claim.device_index]
        logger.info(
            "run %d: claimed (claim %d, lease %s): %s on %s",
            claim.run_id,
            claim.claim_number,
            claim.lease_id,
            claim.spec.model.label,
            device.info.name,
        )
        keeper = _LeaseKeeper(self.heartbeat_client, claim)
        keeper.start()
        runner: TrialRunner | None = None
        progress = _Progress(self.client, keeper)
        # One Optuna study per claim: a study left by an earlier claim of this run (a killed
        # worker sharing this storage) is not continued, nor clobbered. The lease id (random,
        # per claim) keeps names apart across servers: run numbers restart with a new server's
        # database while this worker's store keeps the studies of the old one.
        study_name = f"{claim.study_name}-claim-{claim.claim_number}-{claim.lease_id[:8]}"
        try:
            if self._stopping:
                raise WorkerShutdown(SHUTDOWN_REASON)
            if claim.spec.model.factory is not None:
                # Refused here, before any child starts; the children check again.
                check_factory_allowed(claim.spec.model.factory, self.config.allowed_factories)
            if claim.spec.training.sharding is Sharding.AUTO:
                opened: list[TrialRunner] = []
                result = self._tune_layouts(claim, device, keeper, progress, study_name, opened)
                runner = opened[-1] if opened else None
            else:
                runner = self._runner_for(claim, device, keeper)
                expandable = self._expandable_segments(claim, device, keeper, runner)
                result = self._tune(claim, runner, progress, study_name, keeper, expandable)
            self._patiently(
                keeper, lambda: self.client.submit_result(claim.run_id, claim.lease_id, result)
            )
            logger.info("run %d: result submitted (%s)", claim.run_id, _summary(result))
            return RunOutcome.SUCCEEDED
        except LeaseLost as error:
            logger.warning(
                "run %d: %s; dropping it (%s)",
                claim.run_id,
                "cancelled" if error.cancelled else "lease lost",
                error,
            )
            return RunOutcome.LOST
        except WorkerShutdown as error:
            logger.warning("run %d: released: %s", claim.run_id, error)
            return self._give_up(
                claim,
                keeper,
                error,
                retryable=True,
                outcome=RunOutcome.RELEASED,
                study_name=self._study_of(claim, study_name),
            )
        except Exception as error:  # the one catch-all: no run may take the worker down
            # A refused factory is this worker's choice: one started to allow it may run it.
            retryable = isinstance(error, FactoryRefused) or not isinstance(error, _SPEC_ERRORS)
            logger.error(
                "run %d failed: %s: %s",
                claim.run_id,
                _error_type(error),
                _error_message(error),
                # A refusal is a decision, not a fault: its message says it all.
                exc_info=error if retryable and not isinstance(error, FactoryRefused) else None,
            )
            self._post_failed_trial(claim, runner, progress, study_name, error)
            return self._give_up(
                claim,
                keeper,
                error,
                retryable=retryable,
                outcome=RunOutcome.FAILED,
                study_name=self._study_of(claim, study_name),
            )
        finally:
            keeper.stop()

    def _runner_for(
        self,
        claim: Claim,
        device: WorkerDevice,
        keeper: _LeaseKeeper,
        spec: Spec | None = None,
        interrupt: Callable[[], None] | None = None,
    ) -> TrialRunner:
        """Trials in child processes on a device; or, for an estimate, traced here: no kernel
        runs and nothing is allocated, so there is no device state for a child to protect, and a
        child per trial would rebuild the model each time (seconds for an 8B model).

        Raises:
            ModelBuildError: the estimate's model cannot be built or traced (the spec's fault:
                any worker would fail the same way), with the reason.
            FactoryRefused: a factory this worker does not allow.

        `spec`: one layout of the claim's sharding: auto spec; `interrupt`: the estimate's
        checks when several runners share the run's limits.
        """
        spec = spec or claim.spec
        if device.device_name == ESTIMATE_DEVICE:
            try:
                interrupt = interrupt or self._estimate_interrupt(keeper)
                return self._estimate_runner(claim, device, interrupt, spec)
            except (FactoryRefused, SpecError, ModelBuildError, WorkerShutdown, LeaseLost):
                raise  # the spec's own errors, or a stop that interrupted the build
            except Exception as error:  # whatever building the user's model raised
                raise ModelBuildError(f"{type(error).__name__}: {error}") from error
        return self._child_runner(
            claim, device, keeper, trace_fit=self.config.trace_fit, spec=spec
        )

    def _child_runner(
        self,
        claim: Claim,
        device: WorkerDevice,
        keeper: _LeaseKeeper,
        *,
        trace_fit: bool,
        allocator_conf: str | None = None,
        spec: Spec | None = None,
    ) -> ChildProcessRunner:
        """Trials in children whose CUDA starts with `allocator_conf` (None: the worker's own
        allocator settings)."""
        return ChildProcessRunner(
            spec or claim.spec,
            device.device_name,
            device.memory_bytes,
            gpu=device.gpu,
            timeout_s=self.config.trial_timeout_s,
            interrupt=lambda: self._interrupt(keeper),
            start_method=self.config.start_method,
            allowed_factories=self.config.allowed_factories,
            trace_fit=trace_fit,
            allocator_conf=allocator_conf or settings_text(self.config.allocator_config),
        )

    def _expandable_segments(
        self, claim: Claim, device: WorkerDevice, keeper: _LeaseKeeper, runner: TrialRunner
    ) -> ExpandableSegments | None:
        """The probe's second session: trial children whose CUDA starts with expandable
        segments added to the worker's allocator settings (as `runner`'s device reported them),
        tracing their fit points in the first child. None for an estimate, when the worker
        was told not to, or when its settings have them already."""
        if not isinstance(runner, ChildProcessRunner) or not self.config.expandable_segments:
            return None
        conf = with_expandable_segments(runner.device_info)
        if conf is None:
            return None
        session = self._child_runner(claim, device, keeper, trace_fit=True, allocator_conf=conf)
        return ExpandableSegments(session, session)

    def _estimate_interrupt(self, keeper: _LeaseKeeper) -> Callable[[], None]:
        """What an estimate's trace checks every few dozen operations: a lost lease (a cancel),
        a shutdown past its grace, and the run's time and memory limits."""
        config = self.config
        deadline_s = time.monotonic() + config.estimate_time_limit_s
        rss_limit_bytes = _resident_bytes() + config.estimate_memory_limit_bytes

        def check() -> None:
            self._interrupt(keeper)
            if time.monotonic() > deadline_s:
                raise EstimateLimitExceeded(
                    f"the estimate ran past its time limit of {config.estimate_time_limit_s:g} s "
                    "per run (the worker's --estimate-time-limit; serve's, for its own workers)"
                )
            if _resident_bytes() > rss_limit_bytes:
                raise EstimateLimitExceeded(
                    "the estimate grew the worker's memory by more than its limit of "
                    f"{format_bytes(config.estimate_memory_limit_bytes)} per run (the "
                    "worker's --estimate-memory-limit; serve's, for its own workers)"
                )

        return check

    def _estimate_runner(
        self,
        claim: Claim,
        device: WorkerDevice,
        interrupt: Callable[[], None],
        spec: Spec | None = None,
    ) -> TrialRunner:
        """`spec`: one layout of the claim's sharding: auto spec (default the claim's)."""
        spec = spec or claim.spec
        from autotune.core.gpus.catalogue import find_gpu
        from autotune.core.gpus.cuda_reserve import budget_for
        from autotune.engine.estimate import EstimateRunner

        assert device.gpu is not None
        return EstimateRunner(
            spec,
            gpu=budget_for(find_gpu(device.gpu), spec.training.world_size),
            # This worker's settings, as its inventory reported them.
            allocator_config=self.config.allocator_config,
            allowed_factory_prefixes=list(self.config.allowed_factories),
            interrupt=interrupt,
        )

    def _tune(
        self,
        claim: Claim,
        runner: TrialRunner,
        progress: _Progress,
        study_name: str,
        keeper: _LeaseKeeper,
        expandable: ExpandableSegments | None,
    ) -> TuneResult:
        spec = claim.spec
        # An estimate's trials are traces already; a child runner traces in its first child.
        tracer = runner if isinstance(runner, ChildProcessRunner) and runner.trace_fit else None
        if spec.training.target_global_batch is None:
            # Nothing to tune for: the probe alone answers (largest micro-batch per mode).
            probe = probe_session(
                runner, on_attempt=progress.attempt, tracer=tracer, expandable=expandable
            )
            result = TuneResult(
                spec=spec, device=runner.device_info, probe=probe, trials=[], recommendation=None
            )
        else:
            result = tune_session(
                runner,
                storage_url=self.config.storage_url,
                study_name=study_name,
                target_seconds=self.config.seconds_per_trial,
                on_attempt=progress.attempt,
                on_trial=progress.trial,
                tracer=tracer,
                expandable=expandable,
            )
        return self._with_fit_advice(claim, result, keeper)

    def _with_fit_advice(
        self, claim: Claim, result: TuneResult, keeper: _LeaseKeeper
    ) -> TuneResult:
        """Where micro-batch 1 fits in no mode, what would make the spec fit, traced here (fake
        tensors: nothing runs on the device) under the estimate's limits. Past them the result
        goes without the advice: the probe's answer stands on its own."""
        if not fits_nowhere(result.probe):
            return result
        try:
            probe = with_fit_advice(
                claim.spec,
                result.probe,
                allowed_factory_prefixes=list(self.config.allowed_factories),
                interrupt=self._estimate_interrupt(keeper),
            )
        except EstimateLimitExceeded as limit:
            logger.warning("run %d: no fit advice: %s", claim.run_id, limit)
            return result
        return result.model_copy(update={"probe": probe})

    def _tune_layouts(
        self,
        claim: Claim,
        device: WorkerDevice,
        keeper: _LeaseKeeper,
        progress: _Progress,
        study_name: str,
        opened: list[TrialRunner],
    ) -> TuneResult:
        """sharding: auto: every layout tuned on a runner of its own (`opened` keeps the last,
        whose failure a crashed measurement reports). An estimate's time and memory limits
        are the run's, all layouts together."""
        from autotune.engine.layout_tuning import tune_layouts

        interrupt = (
            self._estimate_interrupt(keeper) if device.device_name == ESTIMATE_DEVICE else None
        )

        def open_layout(spec: Spec) -> tuple[TrialRunner, FitTracer | None]:
            runner = self._runner_for(claim, device, keeper, spec, interrupt)
            opened.append(runner)
            if isinstance(runner, ChildProcessRunner) and runner.trace_fit:
                return runner, runner
            return runner, None

        return tune_layouts(
            claim.spec,
            open_layout,
            storage_url=self.config.storage_url,
            study_name=study_name,
            target_seconds=self.config.seconds_per_trial,
            on_attempt=progress.attempt,
            on_trial=progress.trial,
            on_layout=progress.layout,
        )

    def _post_failed_trial(
        self,
        claim: Claim,
        runner: TrialRunner | None,
        progress: _Progress,
        study_name: str,
        error: Exception,
    ) -> None:
        """A measurement that crashed or raised becomes a FAILED trial on the run."""
        if not isinstance(runner, ChildProcessRunner):
            return  # none was built, or an estimate's: its measurement is arithmetic here
        failure = runner.last_failure
        if failure is None or failure.error is not error or failure.operation != "measure":
            return
        trial = Trial(
            number=self._failed_trial_number(study_name, progress),
            micro_batch=failure.micro_batch,
            accumulation_steps=failure.accumulation_steps,
            checkpointing=failure.checkpointing,
            state=TrialState.FAILED,
            error=str(error)[:2000],
        )
        try:
            progress.trial(trial)
        except LeaseLost as lost:
            logger.warning("run %d: failed trial not stored: %s", claim.run_id, lost)

    def _failed_trial_number(self, study_name: str, progress: _Progress) -> int:
        """The Optuna trial number of the measurement that failed (Optuna marks it FAIL)."""
        import optuna

        storage = optuna.storages.RDBStorage(self.config.storage_url)
        try:
            study = optuna.load_study(study_name=study_name, storage=storage)
            failed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
            if failed:
                return max(t.number for t in failed)
        except KeyError:  # no such study: the failure came before the study was created
            pass
        finally:
            storage.engine.dispose()
        return max(progress.trial_numbers, default=-1) + 1

    def _study_of(self, claim: Claim, study_name: str) -> str | None:
        """`study_name` if this claim created that study in the worker's store, else None
        (a probe-only run has none; a failure may come before the study was created)."""
        if claim.spec.training.target_global_batch is None:
            return None
        import optuna

        storage = optuna.storages.RDBStorage(self.config.storage_url)
        try:
            storage.get_study_id_from_name(study_name)
        except Exception:  # KeyError (no such study), or an unreadable store: the report
            return None  # matters more than the name in it
        finally:
            storage.engine.dispose()
        return study_name

    def _give_up(
        self,
        claim: Claim,
        keeper: _LeaseKeeper,
        error: Exception,
        *,
        retryable: bool,
        outcome: RunOutcome,
        study_name: str | None,
    ) -> RunOutcome:
        try:
            self._patiently(
                keeper,
                lambda: self.client.report_failure(
                    claim.run_id,
                    claim.lease_id,
                    error_type=_error_type(error),
                    message=_error_message(error),
                    traceback_tail=_traceback_tail(error),
                    retryable=retryable,
                    study_name=study_name,
                ),
            )
        except LeaseLost as lost:
            logger.warning("run %d: failure not recorded: %s", claim.run_id, lost)
            return RunOutcome.LOST
        except ServerError as unsent:
            logger.error(
                "run %d: could not report the failure (%s); the lease will expire",
                claim.run_id,
                unsent,
            )
        return outcome

    def _patiently(self, keeper: _LeaseKeeper, call: Callable[[], T]) -> T:
        """`call()` under the lease, retried while the server is unreachable: however long
        the outage, the lease stays renewable until another worker claims the run, so the
        work is kept. Ends when the lease is lost, or the worker must stop now."""
        delay_s = 1.0
        while True:
            try:
                return keeper.call(call)
            except ServerUnavailable as error:
                keeper.check()
                stop_deadline_s = self._stop_deadline_s
                if stop_deadline_s is not None and time.monotonic() > stop_deadline_s:
                    raise
                logger.warning("server unreachable (%s); retrying in %.0f s", error, delay_s)
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, 10.0)


def _resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc; elsewhere its peak, a bound)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _summary(result: TuneResult) -> str:
    rec = result.recommendation
    if rec is not None:
        return (
            f"micro-batch {rec.micro_batch} x {rec.accumulation_steps}, checkpointing "
            f"{'on' if rec.checkpointing else 'off'}, {rec.samples_per_s:.1f} samples/s"
        )
    if result.infeasible is not None:
        return f"infeasible: {result.infeasible.reason}"
    return ", ".join(
        f"max micro-batch {m.max_micro_batch} (checkpointing {'on' if m.checkpointing else 'off'})"
        for m in result.probe.modes
    )
