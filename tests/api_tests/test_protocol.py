"""The wire protocol without a server: JSON round trips, fingerprints, target matching, limits."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import BaseModel, ValidationError

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.schemas import ModelSpec, Spec, TrainingSpec
from autotune.remote.protocol import (
    AttemptEvent,
    AttemptRecord,
    Claim,
    ClaimRequest,
    CudaTarget,
    EmulatedTarget,
    EventAck,
    FailureReport,
    Heartbeat,
    Lease,
    ResultSubmission,
    Run,
    RunCreate,
    RunPage,
    RunStatus,
    RunSummary,
    Submitted,
    TrialEvent,
    TrialRecord,
    cuda_memory_bounds,
    fingerprint,
)
from tests.api_tests.factories import (
    GIB,
    a100,
    attempt,
    cuda_device,
    emulated,
    emulated_device,
    named,
    named_device,
    tiny_spec,
    trial,
    tune_result,
)

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def _examples() -> list[BaseModel]:
    spec = tiny_spec()
    run = Run(
        id=3,
        url="/api/v1/runs/3",
        status=RunStatus.SUCCEEDED,
        fingerprint="ab" * 32,
        spec=spec,
        device=a100(),
        model="gpt2-tiny",
        autotune_version="0.1.0",
        created_at=NOW,
        updated_at=NOW,
        attempts=[
            AttemptRecord(
                claim_number=1,
                sequence=0,
                checkpointing=True,
                attempt=attempt(4, False),
                created_at=NOW,
            )
        ],
        trials=[TrialRecord(claim_number=1, trial=trial(0), created_at=NOW)],
        recommendation=tune_result(spec, emulated_device()).recommendation,
    )
    summary = RunSummary(
        id=3, url="/api/v1/runs/3", status=RunStatus.QUEUED, model="m", device="d", created_at=NOW
    )
    return [
        RunCreate(spec=spec, device=emulated()),
        RunCreate(spec=spec, device=a100()),
        RunCreate(spec=spec, device=named()),
        run,
        summary,
        RunPage(items=[summary], total=1, limit=50, offset=0),
        Submitted(id=3, status=RunStatus.SUCCEEDED, url="/x", cached=True, run=run),
        ClaimRequest(
            worker_id="host-1:gpu", devices=[emulated_device(), cuda_device(), named_device()]
        ),
        Claim(
            run_id=3,
            spec=spec,
            target=emulated(),
            device_index=0,
            lease_id="ab12",
            lease_expires_at=NOW,
            heartbeat_interval_s=10.0,
            claim_number=1,
            study_name="autotune-run-3",
        ),
        Heartbeat(lease_id="ab12"),
        Lease(run_id=3, lease_id="ab12", lease_expires_at=NOW),
        AttemptEvent(lease_id="ab12", sequence=0, checkpointing=False, attempt=attempt(2, True)),
        TrialEvent(lease_id="ab12", trial=trial(1)),
        EventAck(stored=True, lease_expires_at=NOW),
        ResultSubmission(lease_id="ab12", result=tune_result(spec, emulated_device())),
        ResultSubmission(lease_id="ab12", result=tune_result(spec, named_device(world_size=8))),
        FailureReport(lease_id="ab12", error_type="RuntimeError", message="x", retryable=False),
    ]


@pytest.mark.parametrize("model", _examples(), ids=lambda m: type(m).__name__)
def test_every_message_survives_a_json_round_trip(model: BaseModel) -> None:
    assert type(model).model_validate_json(model.model_dump_json()) == model


def test_memory_accepts_sizes_as_text() -> None:
    assert EmulatedTarget.model_validate({"memory_bytes": "4GiB"}).memory_bytes == 4 * GIB
    assert (
        CudaTarget.model_validate({"name": "X", "memory_bytes": "80 GB"}).memory_bytes
        == 80 * 10**9
    )
    with pytest.raises(ValidationError, match="not a memory size"):
        EmulatedTarget.model_validate({"memory_bytes": "lots"})
    with pytest.raises(ValidationError):
        EmulatedTarget.model_validate({"memory_bytes": 0})


def test_fingerprint_is_canonical() -> None:
    spec = tiny_spec()
    spelled_out = Spec.model_validate(
        {
            "training": {
                "headroom": 0.05,
                "seq_len": 64,
                "optimizer": "adamw",
                "target_global_batch": 32,
            },
            "model": {"preset": "gpt2-tiny", "hf_id": None},
        }
    )
    base = fingerprint(spec, emulated(), "0.1.0")
    assert len(base) == 64
    assert fingerprint(spelled_out, EmulatedTarget(memory_bytes="4GiB"), "0.1.0") == base
    assert fingerprint(spec, emulated(2 * GIB), "0.1.0") != base
    assert fingerprint(spec, emulated(), "0.2.0") != base
    assert fingerprint(tiny_spec(65), emulated(), "0.1.0") != base
    other_source = Spec(model=ModelSpec(preset="llama-tiny"), training=TrainingSpec(seq_len=64))
    assert fingerprint(other_source, emulated(), "0.1.0") != base
    # TF32 and the allocator's settings change speed and memory: other fingerprints.
    with_tf32 = spec.model_copy(
        update={"training": spec.training.model_copy(update={"tf32": True})}
    )
    assert fingerprint(with_tf32, emulated(), "0.1.0") != base
    expandable = EmulatedTarget(memory_bytes=4 * GIB, allocator_conf="expandable_segments:True")
    assert fingerprint(spec, expandable, "0.1.0") != base
    # torch's defaults written out are no setting: the fingerprint of a plain target.
    defaults = EmulatedTarget(memory_bytes=4 * GIB, allocator_conf="expandable_segments:False")
    assert defaults.allocator_conf is None
    assert fingerprint(spec, defaults, "0.1.0") == base


def test_hf_config_key_order_does_not_matter() -> None:
    first = Spec.model_validate(
        {
            "model": {"hf_config": {"model_type": "llama", "a": 1, "b": 2}},
            "training": {"seq_len": 8},
        }
    )
    second = Spec.model_validate(
        {
            "model": {"hf_config": {"b": 2, "a": 1, "model_type": "llama"}},
            "training": {"seq_len": 8},
        }
    )
    assert fingerprint(first, a100(), "1") == fingerprint(second, a100(), "1")


def test_emulated_target_matches_only_equal_capacity() -> None:
    target = emulated(4 * GIB)
    assert target.matches(emulated_device(4 * GIB))
    assert not target.matches(emulated_device(4 * GIB - 1))
    assert not target.matches(cuda_device(total_memory_bytes=4 * GIB))


def test_a_named_target_takes_the_catalogue_name_and_one_of_gpu_or_memory() -> None:
    assert EmulatedTarget(gpu="h100-80gb") == EmulatedTarget(gpu="NVIDIA H100 80GB HBM3")
    assert EmulatedTarget(gpu="h100-80gb").gpu == "H100 80GB"
    # On the wire each form has only its own member.
    assert named().model_dump(mode="json") == {"kind": "emulated", "gpu": "H100 80GB"}
    assert emulated().model_dump(mode="json") == {"kind": "emulated", "memory_bytes": 4 * GIB}
    assert named().label == "emulated:H100 80GB"
    with pytest.raises(ValidationError, match="unknown GPU; known: T4, V100 16GB"):
        EmulatedTarget(gpu="H100 PCIe")
    with pytest.raises(ValidationError, match="exactly one"):
        EmulatedTarget(gpu="T4", memory_bytes=GIB)
    with pytest.raises(ValidationError, match="exactly one"):
        EmulatedTarget()


def test_a_named_target_is_fingerprinted_by_its_gpu() -> None:
    spec = tiny_spec()
    h100 = fingerprint(spec, named("H100 80GB"), "0.1.0")
    assert fingerprint(spec, named("h100-80gb"), "0.1.0") == h100
    assert fingerprint(spec, named("A100 80GB"), "0.1.0") != h100
    # Not the plain emulated device of the card's memory either.
    memory = find_gpu("H100 80GB").total_memory_bytes
    assert fingerprint(spec, emulated(memory), "0.1.0") != h100
    # Plain targets keep the identity (so the fingerprints) they had before named GPUs.
    assert emulated().identity() == {"kind": "emulated", "memory_bytes": 4 * GIB}
    assert named().identity() == {"kind": "emulated", "gpu": "H100 80GB"}


def test_a_named_target_matches_its_gpu_at_any_world_size_and_nothing_else() -> None:
    target = named("H100 80GB")
    assert target.matches(named_device("H100 80GB"))
    assert target.matches(named_device("H100 80GB", world_size=8))  # another capacity
    assert not target.matches(named_device("H200 141GB"))
    alone = named_device("H100 80GB")
    assert not target.matches(emulated_device(alone.capacity_bytes))
    # A plain target never takes a named device, even of equal capacity.
    assert not emulated(alone.capacity_bytes).matches(alone)


def test_cuda_bounds_agree_with_matches() -> None:
    total = 81_920 * 2**20
    low, high = cuda_memory_bounds(total)
    device = cuda_device(total_memory_bytes=total)
    for memory, expected in ((low, True), (low - 1, False), (high, True), (high + 1, False)):
        assert CudaTarget(name=device.name, memory_bytes=memory).matches(device) is expected


@pytest.mark.parametrize(
    "bad",
    [
        {"worker_id": "w", "devices": []},
        {"worker_id": "has space", "devices": [emulated_device().model_dump()]},
        {
            "worker_id": "w",
            "devices": [{**emulated_device().model_dump(), "capacity_bytes": 2**64}],
        },
        {"worker_id": "w", "devices": [{**emulated_device().model_dump(), "name": "a\x00"}]},
    ],
)
def test_claim_request_refuses_what_a_database_cannot_store(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ClaimRequest.model_validate(bad)


def test_events_refuse_non_finite_numbers() -> None:
    bad_trial = trial(0).model_dump() | {"samples_per_s": float("nan")}
    with pytest.raises(ValidationError, match="finite"):
        TrialEvent.model_validate({"lease_id": "ab", "trial": bad_trial})


def test_run_status_knows_which_are_finished() -> None:
    assert [s.value for s in RunStatus if s.is_finished()] == ["succeeded", "failed", "cancelled"]
