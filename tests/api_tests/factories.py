"""Payloads for the API tests: tiny specs, worker devices and canned tune results."""

from __future__ import annotations

from autotune.core.exports import build_exports
from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.schemas import (
    AllocatorOption,
    DeviceInfo,
    DeviceKind,
    ModelSpec,
    ModeProbe,
    OomDetail,
    Phase,
    ProbeResult,
    Recommendation,
    Spec,
    SpeedSource,
    StepOutcome,
    TracedFit,
    TrainingSpec,
    Trial,
    TrialState,
    TuneResult,
)
from autotune.remote.client import ServerClient
from autotune.remote.protocol import CudaTarget, EmulatedTarget

GIB = 2**30


def tiny_spec(seq_len: int = 64, target_global_batch: int = 32) -> Spec:
    return Spec(
        model=ModelSpec(preset="gpt2-tiny"),
        training=TrainingSpec(seq_len=seq_len, target_global_batch=target_global_batch),
    )


def emulated(memory_bytes: int = 4 * GIB) -> EmulatedTarget:
    return EmulatedTarget(memory_bytes=memory_bytes)


def emulated_device(capacity_bytes: int = 4 * GIB, index: int = 0) -> DeviceInfo:
    return DeviceInfo(
        kind=DeviceKind.EMULATED,
        name="cpu",
        index=index,
        total_memory_bytes=24 * GIB,
        capacity_bytes=capacity_bytes,
        torch_version="2.13.0+cpu",
        speed=SpeedSource.CPU_TIMING,
    )


def named(gpu: str = "H100 80GB") -> EmulatedTarget:
    return EmulatedTarget(gpu=gpu)


def named_device(gpu: str = "H100 80GB", world_size: int = 1, index: int = 0) -> DeviceInfo:
    """What a worker started with `--gpu` offers (and, for `world_size`, what its runs report)."""
    budget = budget_for(find_gpu(gpu), world_size)
    return DeviceInfo(
        kind=DeviceKind.EMULATED,
        name=f"emulated {budget.gpu.name} on cpu",
        index=index,
        total_memory_bytes=budget.gpu.total_memory_bytes,
        capacity_bytes=budget.capacity_bytes,
        torch_version="2.13.0+cpu",
        gpu=budget.gpu.name,
        reserve=budget.reserve,
        assumptions=list(budget.assumptions),
    )


def estimate_device(gpu: str = "H100 80GB", index: int = 0) -> DeviceInfo:
    """What a worker started with `--device estimate` offers for one catalogue GPU."""
    return named_device(gpu, index=index).model_copy(
        update={"kind": DeviceKind.ESTIMATE, "name": f"estimate for {gpu}"}
    )


def cuda_device(
    name: str = "NVIDIA A100-SXM4-80GB", total_memory_bytes: int = 80 * GIB, index: int = 0
) -> DeviceInfo:
    return DeviceInfo(
        kind=DeviceKind.CUDA,
        name=name,
        index=index,
        uuid=f"GPU-{index}",
        total_memory_bytes=total_memory_bytes,
        capacity_bytes=total_memory_bytes - GIB,
        driver_version="560.35",
        cuda_version="12.6",
        torch_version="2.13.0+cu126",
    )


def a100() -> CudaTarget:
    return CudaTarget(name="NVIDIA A100-SXM4-80GB", memory_bytes=80 * GIB)


def attempt(micro_batch: int, fits: bool) -> StepOutcome:
    return StepOutcome(
        micro_batch=micro_batch,
        fits=fits,
        peak_bytes=micro_batch * 10_000_000,
        peak_allocated_bytes=micro_batch * 8_000_000,
        num_alloc_retries=0 if fits else 1,
        phase_peak_bytes={Phase.FORWARD: micro_batch * 6_000_000},
        oom_phase=None if fits else Phase.BACKWARD,
        oom=None if fits else oom_detail(micro_batch),
    )


def oom_detail(micro_batch: int) -> OomDetail:
    """What an emulated GPU reports of an out-of-memory in backward at `micro_batch`."""
    return OomDetail(
        allocation_bytes=2 * 2**20,
        phase=Phase.BACKWARD,
        op="aten.mm.default",
        weights_bytes=4_000_000,
        gradients_bytes=3_000_000,
        optimizer_state_bytes=8_000_000,
        activations_bytes=micro_batch * 5_000_000,
        cache_bytes=1_000_000,
    )


def trial(number: int, micro_batch: int = 8, accumulation_steps: int = 4) -> Trial:
    return Trial(
        number=number,
        micro_batch=micro_batch,
        accumulation_steps=accumulation_steps,
        checkpointing=False,
        state=TrialState.COMPLETE,
        samples_per_s=100.0 + number,
        tokens_per_s=(100.0 + number) * 64,
        step_time_s=micro_batch * accumulation_steps / (100.0 + number),
        step_time_spread=0.05,
        timed_steps=3,
        peak_bytes=80_000_000,
    )


def tune_result(spec: Spec, device: DeviceInfo, *, study_name: str | None = None) -> TuneResult:
    """A finished result for a `tiny_spec` (target 32) that passes every check of
    `autotune.core.tuning.result_check`: max micro-batch 8 without checkpointing, 16 with; two
    trials, the faster of which (8 x 4) is the recommendation."""
    modes = [
        ModeProbe(
            checkpointing=False,
            max_micro_batch=8,
            recommended_micro_batch=8,
            capped=False,
            attempts=[attempt(1, True), attempt(16, False), attempt(8, True), attempt(9, False)],
            accumulating_micro_batch=8,
        ),
        ModeProbe(
            checkpointing=True,
            max_micro_batch=16,
            recommended_micro_batch=16,
            capped=False,
            attempts=[attempt(16, True), attempt(17, False)],
            # The fit the trial-free trace gave this mode's search (autotune.engine.fit_points).
            traced=TracedFit(
                predicted_max_micro_batch=16, fit_points=[attempt(2, True), attempt(3, True)]
            ),
        ),
    ]
    recommendation = Recommendation(
        micro_batch=8,
        accumulation_steps=4,
        checkpointing=False,
        world_size=1,
        global_batch=32,
        samples_per_s=101.0,
        tokens_per_s=6464.0,
        peak_bytes=80_000_000,
        capacity_bytes=device.capacity_bytes,
    )
    return TuneResult(
        spec=spec,
        device=device,
        probe=ProbeResult(device=device, modes=modes),
        trials=[trial(0, micro_batch=4, accumulation_steps=8), trial(1)],
        recommendation=recommendation,
        exports=build_exports(
            recommendation, token_model=True, transformers_version=None, training=spec.training
        ),
        study_name=study_name,
    )


EXPANDABLE = "expandable_segments:True"


def expandable_tune_result(spec: Spec, device: DeviceInfo) -> TuneResult:
    """`tune_result` where expandable segments fit 16 plain (the default allocator 8, with or
    without accumulating), and 16 x 2 measured under them is the fastest: the recommendation
    and its exports hold for them. Passes every check of `autotune.core.tuning.result_check`."""
    valid = tune_result(spec, device)
    plain, checkpointed = valid.probe.modes
    option = AllocatorOption(
        allocator_conf=EXPANDABLE,
        traced_max_micro_batch=16,
        max_micro_batch=16,
        recommended_micro_batch=16,
        accumulating_micro_batch=16,
        trials=2,
        recommended=True,
    )
    modes = [plain.model_copy(update={"expandable_segments": option}), checkpointed]
    faster = trial(2, micro_batch=16, accumulation_steps=2).model_copy(
        update={
            "allocator_conf": EXPANDABLE,
            "samples_per_s": 200.0,
            "tokens_per_s": 200.0 * 64,
            "step_time_s": 32 / 200.0,
        }
    )
    assert valid.recommendation is not None
    rec = valid.recommendation.model_copy(
        update={
            "micro_batch": 16,
            "accumulation_steps": 2,
            "samples_per_s": 200.0,
            "tokens_per_s": 200.0 * 64,
            "allocator_conf": EXPANDABLE,
        }
    )
    exports = build_exports(
        rec, token_model=True, transformers_version=None, training=spec.training
    )
    return valid.model_copy(
        update={
            "probe": valid.probe.model_copy(update={"modes": modes}),
            "trials": [*valid.trials, faster],
            "recommendation": rec,
            "exports": exports,
        }
    )


def finished_run(user: ServerClient, worker: ServerClient, seq_len: int = 64) -> int:
    """Submit a `tiny_spec(seq_len)`, claim it and finish it with `tune_result`; its run id."""
    spec = tiny_spec(seq_len)
    run_id = user.submit_run(spec, emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None and claim.run_id == run_id
    worker.submit_result(run_id, claim.lease_id, tune_result(spec, emulated_device()))
    return run_id


# sharding: auto on two ranks of an MLP: every layout fits, so every one is tuned and ranked.
AUTO_LAYOUT_SPEC = Spec.model_validate(
    {
        "model": {"preset": "mlp"},
        "training": {
            "world_size": 2,
            "sharding": "auto",
            "target_global_batch": 8,
            "max_micro_batch": 4,
        },
    }
)


def auto_layout_result(storage_url: str, gpu: str = "H100 80GB") -> TuneResult:
    """`AUTO_LAYOUT_SPEC` tuned for real, estimated for two `gpu`s (the Optuna studies in
    `storage_url`)."""
    from autotune.core.gpus.catalogue import find_gpu
    from autotune.core.gpus.cuda_reserve import budget_for
    from autotune.engine.estimate import EstimateRunner
    from autotune.engine.layout_tuning import tune_layouts

    budget = budget_for(find_gpu(gpu), AUTO_LAYOUT_SPEC.training.world_size)
    return tune_layouts(
        AUTO_LAYOUT_SPEC,
        lambda layout: (EstimateRunner(layout, gpu=budget), None),
        storage_url=storage_url,
    )
