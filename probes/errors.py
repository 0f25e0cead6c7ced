"""The errors of the probe worker, under `autotune.core.errors.AutotuneError`.

* AutotuneError
  + TrialCrashed       a trial's child process died by a signal, exited without an answer, or
                       ran past its time limit; never an out-of-memory verdict
  + TrialError         the trial raised an exception that is not autotune's own (a bug in the
                       user's model, a CUDA error); carries the child's type name and traceback
  + WorkerShutdown     the worker was told to stop (SIGTERM, Ctrl-C) and the run did not finish
                       within the grace period
* SpecError
  + EstimateLimitExceeded  an estimate ran past the worker's time or memory limit per run

Errors the child raises that autotune defines (SpecError, ModelBuildError, DeviceError, ...)
are re-raised in the parent as themselves.
"""

from __future__ import annotations

from autotune.core.errors import AutotuneError, SpecError


class TrialCrashed(AutotuneError):
    """A trial's child process ended without an answer.

    Attributes:
        operation: "describe", "warm_up", "trial" or "measure".
        reason: e.g. "killed by SIGABRT", "timed out after 30 s", "exited with code 1".
    """

    def __init__(
        self,
        operation: str,
        reason: str,
        *,
        micro_batch: int | None = None,
        accumulation_steps: int = 1,
        checkpointing: bool = False,
        checkpointed_blocks: int | None = None,
    ) -> None:
        where = ""
        if micro_batch is not None:
            mode = "on" if checkpointing else "off"
            if checkpointing and checkpointed_blocks is not None:
                mode = f"on for the first {checkpointed_blocks} blocks"
            where = (
                f" at micro-batch {micro_batch} x {accumulation_steps} accumulation step(s), "
                f"checkpointing {mode}"
            )
        super().__init__(f"{operation}{where}: child process {reason}")
        self.operation = operation
        self.reason = reason
        self.micro_batch = micro_batch
        self.accumulation_steps = accumulation_steps
        self.checkpointing = checkpointing


class TrialError(AutotuneError):
    """An exception raised inside a trial's child process, re-raised in the parent.

    `error_type` is the child's exception class name (e.g. "ValueError"), `child_traceback`
    the formatted traceback from the child.
    """

    def __init__(self, error_type: str, message: str, child_traceback: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.child_message = message
        self.child_traceback = child_traceback


class EstimateLimitExceeded(SpecError):
    """An estimate took longer, or grew the worker by more memory, than one run may: the spec
    asks too much of an estimate (any worker would stop it), so the run fails, saying which
    limit and how to raise it."""


class WorkerShutdown(AutotuneError):
    """The worker is stopping; the current run is handed back to the server."""
