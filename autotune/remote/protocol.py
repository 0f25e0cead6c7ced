"""The wire protocol between users, the API server and probe workers: pydantic models, torch-free.

Everything here is built on `autotune.core.schemas`; the server (`api/`) validates requests with
these models and `autotune.remote.client.ServerClient` parses responses with them, so both ends
share one definition. The module also owns the two pure rules both ends must agree on: how a device
target matches a worker's device, and how a submission is fingerprinted for the result cache.
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from autotune.core.bytesize import parse_bytes
from autotune.core.gpus.catalogue import KNOWN_NAMES, UnknownGpu, find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.memory.allocator_config import (
    AllocatorConfigError,
    canonical_conf,
    parse_alloc_conf,
)
from autotune.core.parallel.topology import box_problem
from autotune.core.schemas import (
    ALLOCATOR_CONF_MAX,
    DEVICE_NAME_MAX,
    STUDY_NAME_MAX,
    DeviceInfo,
    DeviceKind,
    Exports,
    FitAdvice,
    FrozenModel,
    Infeasible,
    Layouts,
    ModeProbe,
    Recommendation,
    Spec,
    StepOutcome,
    Trial,
    TuneResult,
)
from autotune.core.tuning.throughput import CPU_TIMING, speed_label

API_PREFIX = "/api/v1"
# Databases store 64-bit signed integers; anything larger in a payload is refused with a 422
# instead of overflowing in the driver (a 500).
MAX_INT = 2**63 - 1
# A cuda target matches a GPU whose total memory is within this fraction of the target memory:
# the same model is reported with slightly different totals by different drivers.
CUDA_MEMORY_TOLERANCE = 0.03
MAX_PAGE_LIMIT = 200


class RunStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def is_finished(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


def _memory_size(value: object) -> object:
    """Accept "80GiB" as well as a byte count; anything else is left to pydantic."""
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except ValueError as error:
            raise ValueError(str(error)) from None
    return value


MemoryBytes = Annotated[int, BeforeValidator(_memory_size), Field(ge=1, le=MAX_INT)]
_Text = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f]+$")]


def _as_utc(value: datetime) -> datetime:
    # Converting +14:00 on 0001-01-01 (or -14:00 on 9999-12-31) leaves the datetime range.
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("out of range once converted to UTC") from None


UtcDatetime = Annotated[AwareDatetime, AfterValidator(_as_utc)]
"""A timestamp with its offset (a naive one is ambiguous), as UTC; for query parameters."""


def cuda_memory_bounds(total_memory_bytes: int) -> tuple[int, int]:
    """The range of target memories a GPU with this total memory matches (inclusive).

    |total - target| <= tolerance * target  <=>  total / (1 + tol) <= target <= total / (1 - tol).
    Integer bounds so that the SQL filter and `matches` below are one rule.
    """
    low = math.ceil(total_memory_bytes / (1 + CUDA_MEMORY_TOLERANCE))
    high = math.floor(total_memory_bytes / (1 - CUDA_MEMORY_TOLERANCE))
    return low, min(high, MAX_INT)


def _gpu_name(value: str) -> str:
    """A catalogue GPU name or alias, as its canonical name, so that "h100-80gb" and
    "H100 80GB" are one target (and one fingerprint)."""
    try:
        return find_gpu(value).name
    except UnknownGpu:
        # Not the catalogue's message: it quotes the name sent, which a server does not repeat.
        raise ValueError(f"unknown GPU; known: {KNOWN_NAMES}") from None


GpuName = Annotated[str, Field(min_length=1, max_length=100), AfterValidator(_gpu_name)]


def _allocator_conf(value: str | None) -> str | None:
    # Stored in canonical form: settings written differently but equal are one fingerprint,
    # and torch's defaults are no setting at all.
    if value is None:
        return None
    try:
        return canonical_conf(parse_alloc_conf(value))
    except AllocatorConfigError as error:
        raise ValueError(str(error)) from None


AllocatorConf = Annotated[
    str | None, Field(max_length=ALLOCATOR_CONF_MAX), AfterValidator(_allocator_conf)
]
"""A `PYTORCH_ALLOC_CONF` string the run's device must use (None: torch's defaults)."""


class EmulatedTarget(FrozenModel):
    """A CPU worker that emulates a GPU: of `memory_bytes` (what the step's tensors may use), or
    the named `gpu` of `autotune.core.gpus.catalogue` (its memory less what CUDA takes on it).
    Exactly one of the two."""

    kind: Literal["emulated"] = "emulated"
    memory_bytes: MemoryBytes | None = None
    gpu: GpuName | None = None
    allocator_conf: AllocatorConf = None

    @model_validator(mode="after")
    def _memory_or_gpu(self) -> EmulatedTarget:
        if (self.memory_bytes is None) == (self.gpu is None):
            raise ValueError("give memory_bytes or gpu (a named GPU), exactly one")
        return self

    @model_serializer(mode="wrap")
    def _without_the_other(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # {"kind", "memory_bytes"} or {"kind", "gpu"}: the member not given is left out.
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if value is not None}

    def identity(self) -> dict[str, Any]:
        if self.gpu is not None:
            return _with_allocator({"kind": self.kind, "gpu": self.gpu}, self.allocator_conf)
        identity = {"kind": self.kind, "memory_bytes": self.memory_bytes}
        return _with_allocator(identity, self.allocator_conf)

    def matches(self, device: DeviceInfo) -> bool:
        if device.kind != DeviceKind.EMULATED or device.allocator_conf != self.allocator_conf:
            return False
        if self.gpu is not None:
            # A named GPU's capacity depends on the spec's world size: the name is the match.
            return device.gpu == self.gpu
        return device.gpu is None and device.capacity_bytes == self.memory_bytes

    @property
    def label(self) -> str:
        return f"emulated:{self.gpu if self.gpu is not None else self.memory_bytes}"

    def max_capacity_bytes(self, world_size: int) -> int:
        """The most a step may use on a device this target matches."""
        if self.gpu is not None:
            return budget_for(find_gpu(self.gpu), world_size).capacity_bytes
        assert self.memory_bytes is not None
        return self.memory_bytes


class _UnsetLeftOut(FrozenModel):
    """Serialised without its unset (None) fields: a target's JSON is what its user wrote."""

    @model_serializer(mode="wrap")
    def _without_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if value is not None}


class CudaTarget(_UnsetLeftOut):
    """A real GPU model, e.g. name "NVIDIA A100-SXM4-80GB" with its total memory."""

    kind: Literal["cuda"] = "cuda"
    name: Annotated[_Text, Field(max_length=DEVICE_NAME_MAX)]
    memory_bytes: MemoryBytes
    allocator_conf: AllocatorConf = None

    def identity(self) -> dict[str, Any]:
        identity = {"kind": self.kind, "name": self.name, "memory_bytes": self.memory_bytes}
        return _with_allocator(identity, self.allocator_conf)

    def matches(self, device: DeviceInfo) -> bool:
        low, high = cuda_memory_bounds(device.total_memory_bytes)
        return (
            device.kind == DeviceKind.CUDA
            and device.name == self.name
            and low <= self.memory_bytes <= high
            and device.allocator_conf == self.allocator_conf
        )

    @property
    def label(self) -> str:
        return self.name

    def max_capacity_bytes(self, world_size: int) -> int:
        """At most the memory of the largest card this target matches."""
        return min(math.floor(self.memory_bytes * (1 + CUDA_MEMORY_TOLERANCE)), MAX_INT)


class EstimateTarget(_UnsetLeftOut):
    """An estimate for the named `gpu` of `autotune.core.gpus.catalogue`: the emulated GPU's step
    traced on fake tensors (`autotune.engine.estimate`), no device needed; speed by roofline. Its
    answers are never a measurement's: a run of this target answers only estimate requests."""

    kind: Literal["estimate"] = "estimate"
    gpu: GpuName
    allocator_conf: AllocatorConf = None

    @property
    def memory_bytes(self) -> None:
        """No memory of its own: the named GPU's (one rank's, for the spec's world size)."""
        return None

    def identity(self) -> dict[str, Any]:
        return _with_allocator({"kind": self.kind, "gpu": self.gpu}, self.allocator_conf)

    def matches(self, device: DeviceInfo) -> bool:
        return (
            device.kind == DeviceKind.ESTIMATE
            and device.gpu == self.gpu
            and device.allocator_conf == self.allocator_conf
        )

    @property
    def label(self) -> str:
        return f"estimate:{self.gpu}"

    def max_capacity_bytes(self, world_size: int) -> int:
        return budget_for(find_gpu(self.gpu), world_size).capacity_bytes


def _label_speed(label: str) -> str:
    """`speed_label` from a target's stored `label` alone (`emulated:1073741824`,
    `emulated:H100 80GB`, `estimate:T4`, or a CUDA GPU's name), for a listing of runs."""
    kind, _, what = label.partition(":")
    if kind == "emulated":
        return CPU_TIMING if what.isdigit() else f"estimated for {what}"
    if kind == "estimate":
        return f"estimated for {what}"
    return "measured"


def _with_allocator(identity: dict[str, Any], allocator_conf: str | None) -> dict[str, Any]:
    # Only when set: a run on torch's default settings keeps the fingerprint it always had.
    return identity if allocator_conf is None else {**identity, "allocator_conf": allocator_conf}


AnyTarget = EmulatedTarget | CudaTarget | EstimateTarget
DeviceTarget = Annotated[AnyTarget, Field(discriminator="kind")]


def fingerprint(spec: Spec, target: AnyTarget, autotune_version: str) -> str:
    """sha256 of the canonical JSON of (spec with defaults, device identity, autotune version).

    Two submissions with the same fingerprint would measure the same thing, so a succeeded run
    answers both. The torch version of the worker is recorded on the run when it finishes.
    """
    canonical = json.dumps(
        {
            "spec": spec.identity(),
            "device": target.identity(),
            "autotune": autotune_version,
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _storable(value: object, path: str) -> None:
    """Refuse what a database cannot store: integers beyond 64 bits, NaN/inf, NUL characters,
    and lone surrogates (JSON's \\uXXXX escapes can carry them; no UTF-8 column, response or
    log line can hold one, so a stored one would break every later read of its run)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -MAX_INT - 1 <= value <= MAX_INT:
            raise ValueError(f"{path}: integer out of range")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: must be a finite number")
    elif isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{path}: NUL characters are not allowed")
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ValueError(f"{path}: not valid Unicode (a lone surrogate)") from None


def _walk(value: object, path: str) -> None:
    """`_storable` on every scalar under `value`: model fields, dict keys and items, lists."""
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            _walk(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _storable(key, f"{path} key")
            _walk(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _walk(item, f"{path}[{index}]")
    else:
        _storable(value, path)


class _Storable(FrozenModel):
    """A request body whose every value fits the database: every request body is one, so this
    is where text and numbers from outside are checked once.

    Checked per top-level field, after that field's own validation, so that a 422 names the
    field (its location) and the path inside it (the message).
    """

    @field_validator("*", mode="after")
    @classmethod
    def _fits_the_database(cls, value: Any, info: ValidationInfo) -> Any:
        _walk(value, str(info.field_name))
        return value


# ---------------------------------------------------------------------------------------------
# Users: submitting and browsing runs.


class RunCreate(_Storable):
    """What a user POSTs: the spec and the device to tune it for."""

    spec: Spec
    device: DeviceTarget

    @model_validator(mode="after")
    def _node_is_a_real_box(self) -> RunCreate:
        gpu = getattr(self.device, "gpu", None)
        if gpu is not None and (problem := box_problem(self.spec.training, find_gpu(gpu))):
            raise ValueError(f"spec.{problem}")
        return self


class AttemptRecord(FrozenModel):
    """One probe attempt as stored: the attempt, its mode and which claim produced it."""

    claim_number: int
    sequence: int
    checkpointing: bool
    attempt: StepOutcome
    created_at: datetime


class TrialRecord(FrozenModel):
    claim_number: int
    trial: Trial
    created_at: datetime


class FailureRecord(FrozenModel):
    """Why one claim of a run ended without a result (a worker error or an expired lease)."""

    claim_number: int
    worker_id: str | None
    error_type: str
    message: str
    traceback_tail: str | None = None
    created_at: datetime


class RunSummary(FrozenModel):
    """One row of the run listing."""

    id: int
    url: str
    status: RunStatus
    model: str
    device: str
    created_at: datetime
    finished_at: datetime | None = None
    micro_batch: int | None = None
    accumulation_steps: int | None = None
    checkpointing: bool | None = None
    samples_per_s: float | None = None

    @property
    def speed_label(self) -> str:
        """Where its samples/s come from (`autotune.core.tuning.throughput.speed_label`)."""
        return _label_speed(self.device)


class Run(FrozenModel):
    """Everything the server knows about one run."""

    id: int
    url: str
    status: RunStatus
    fingerprint: str
    spec: Spec
    device: DeviceTarget
    model: str
    autotune_version: str
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    lease_expires_at: datetime | None = None
    lease_lapsed_at: datetime | None = Field(
        default=None,
        description="When the current claim's lease lapsed, if it did (renewed by its holder "
        "afterwards, or requeued until another claim takes the run).",
    )
    queued_s: float | None = Field(default=None, description="Creation to the last claim.")
    run_s: float | None = Field(default=None, description="Last claim to finish.")
    claim_count: int = 0
    worker_id: str | None = None
    worker_device: DeviceInfo | None = None
    torch_version: str | None = None
    study_name: str | None = None
    recommendation: Recommendation | None = None
    infeasible: Infeasible | None = None
    fit_advice: FitAdvice | None = Field(
        default=None,
        description="When micro-batch 1 fits in no mode: the changes that would make it fit.",
    )
    exports: Exports | None = None
    layouts: Layouts = Field(
        default_factory=list,
        description="sharding: auto: every layout measured, the chosen one first.",
    )
    modes: list[ModeProbe] = Field(default_factory=list, description="Final probe per mode.")
    attempts: list[AttemptRecord] = Field(default_factory=list)
    trials: list[TrialRecord] = Field(default_factory=list)
    failures: list[FailureRecord] = Field(default_factory=list)
    error: str | None = None
    notice: str | None = Field(
        default=None,
        description="Why a queued run may wait: no worker has offered its device lately.",
    )

    @property
    def speed_label(self) -> str:
        """Where its samples/s come from: its worker's device, else its target."""
        if self.worker_device is not None:
            return speed_label(self.worker_device)
        return _label_speed(self.device.label)


class Submitted(FrozenModel):
    """The answer to POST /runs: 200 with the finished run (cached or waited for), else 202."""

    id: int
    status: RunStatus
    url: str
    cached: bool
    run: Run | None = None
    notice: str | None = Field(
        default=None, description="As the run's: no worker has offered its device lately."
    )


class ModeComparison(FrozenModel):
    """One checkpointing mode's largest micro-batch, estimated and measured."""

    checkpointing: bool
    estimated_max_micro_batch: int
    measured_max_micro_batch: int
    error_micro_batches: int = Field(description="Estimated less measured.")


class Comparison(FrozenModel):
    """An estimate and a measurement of the same spec on the same GPU, side by side: the
    estimate's error on that card (`GET /runs/{id}/comparison`, from either run)."""

    gpu: str
    estimate_run_id: int
    measured_run_id: int
    measured_device: DeviceTarget
    modes: list[ModeComparison]
    estimated_samples_per_s: float | None = None
    measured_samples_per_s: float | None = None
    speed_error: float | None = Field(
        default=None, description="Estimated over measured samples/s of the recommendations, - 1."
    )


class RunPage(FrozenModel):
    items: list[RunSummary]
    total: int
    limit: int
    offset: int


class EstimateWorkerState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"  # it exited; started again after a back-off
    STOPPED = "stopped"  # the server is stopping


class EstimateWorkerHealth(FrozenModel):
    """One of the estimate workers `autotune serve` runs beside itself (`api.estimate_worker`)."""

    worker_id: str = Field(description="The id its runs record as their worker.")
    state: EstimateWorkerState
    pid: int | None = Field(default=None, description="Its process id while it runs.")
    restarts: int = Field(description="Times it exited and was started again.")
    last_exit: str | None = Field(default=None, description="How it last exited, if it did.")


class Health(FrozenModel):
    status: Literal["ok"]
    database: Literal["ok"]
    version: str
    estimate_workers: list[EstimateWorkerHealth] = Field(
        default_factory=list,
        description="The embedded estimate workers (serve --estimate-workers); none where this "
        "server process runs none (--no-estimates, no torch, or several server processes).",
    )


class ErrorBody(FrozenModel):
    """Body of every non-422 error: a stable machine code and a human message."""

    code: str
    detail: str


# ---------------------------------------------------------------------------------------------
# Workers: claim, heartbeat, stream events, finish.

_WorkerId = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[\w.:@-]+$")]
_LeaseId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[0-9a-f]+$")]


class ClaimRequest(_Storable):
    """A worker asking for work, with every device it could run it on."""

    worker_id: _WorkerId
    devices: list[DeviceInfo] = Field(min_length=1, max_length=64)


class Claim(FrozenModel):
    """The run handed to a worker, under a lease it must renew before `lease_expires_at`."""

    run_id: int
    spec: Spec
    target: DeviceTarget
    device_index: int = Field(description="Index into the devices the worker sent.")
    lease_id: str
    lease_expires_at: datetime
    heartbeat_interval_s: float
    claim_number: int
    study_name: str


class Heartbeat(_Storable):
    lease_id: _LeaseId


class Lease(FrozenModel):
    run_id: int
    lease_id: str
    lease_expires_at: datetime


class AttemptEvent(_Storable):
    """A probe attempt streamed as it finishes; (run, lease, sequence) makes retries harmless."""

    lease_id: _LeaseId
    sequence: int = Field(ge=0, le=1_000_000)
    checkpointing: bool
    attempt: StepOutcome


class TrialEvent(_Storable):
    """A trial streamed as it finishes; (run, lease, trial number) makes retries harmless."""

    lease_id: _LeaseId
    trial: Trial


class EventAck(FrozenModel):
    stored: bool = Field(description="False when this event had been stored before.")
    lease_expires_at: datetime


class ResultSubmission(_Storable):
    """The final result; it replaces the attempts and trials streamed under the same lease."""

    lease_id: _LeaseId
    result: TuneResult


class FailureReport(_Storable):
    """A worker giving up on a run. Retryable failures requeue it until the attempt limit."""

    lease_id: _LeaseId
    error_type: Annotated[str, Field(min_length=1, max_length=200)]
    message: Annotated[str, Field(max_length=10_000)]
    traceback_tail: Annotated[str, Field(max_length=10_000)] | None = None
    retryable: bool = True
    study_name: Annotated[str, Field(min_length=1, max_length=STUDY_NAME_MAX)] | None = Field(
        default=None, description="The Optuna study this claim created, if it got that far."
    )
