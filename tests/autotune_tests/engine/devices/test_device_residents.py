"""The emulated GPU's residents after the warm-up: every later trial starts with them where the
warm-up left them, as on a card (docs/design.md#the-caching-allocator-on-the-emulated-gpu); the
simulated CUDA backend, where they stay where the warm-up put them because the allocator lives
on, measures the same step to the byte."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.memory.allocation_trace import replay_encoded
from autotune.core.schemas import Spec, StepOutcome
from autotune.engine.devices.cuda_device import CudaDevice
from autotune.engine.devices.device import EmulatedDevice, open_device
from autotune.engine.devices.simulated_cuda import MigSlice, SimulatedCuda
from autotune.engine.runner import InProcessRunner

MiB = 2**20
MLP = Spec.model_validate(
    {"model": {"preset": "mlp"}, "training": {"max_micro_batch": 4096, "precision": "bf16"}}
)


def test_the_mlp_checkpointed_fits_in_42_mib_from_the_warm_up_s_placement() -> None:
    """bf16 AdamW: with the residents packed first into a fresh allocator the checkpointed
    step ran out at micro-batch 1 (its optimizer's 4 MiB square root found no hole); from where
    the warm-up left them (the Adam state made after backward's gradients) it fits."""
    runner = InProcessRunner(MLP, open_device("cpu", 42 * MiB))
    assert runner.warm_up(checkpointing=False).fits
    device = runner.device
    assert isinstance(device, EmulatedDevice) and device.placement is not None
    for micro_batch in (1, 2, 8, 64):
        outcome = runner.trial(micro_batch, checkpointing=True)
        assert outcome.fits and outcome.start is not None
        assert outcome.allocations is not None
        # The trace replayed from its start is the trial, figure for figure: what the probe's
        # predictions replay.
        replayed = replay_encoded(outcome.allocations, 42 * MiB, start=outcome.start)
        assert replayed.fits
        assert replayed.stats.peak_reserved_bytes == outcome.peak_bytes
        assert replayed.stats.peak_allocated_bytes == outcome.peak_allocated_bytes
        assert replayed.stats.num_alloc_retries == outcome.num_alloc_retries
        # The same allocations from packed residents run out, as every trial did before.
        assert not replay_encoded(outcome.allocations, 42 * MiB).fits


def _figures(outcome: StepOutcome) -> tuple[bool, int, int | None, int | None]:
    return (
        outcome.fits,
        outcome.peak_bytes,
        outcome.peak_allocated_bytes,
        outcome.num_alloc_retries,
    )


@pytest.mark.e2e  # 18-30 s each in a clean clone's make test (real steps up to 4,096 samples)
@pytest.mark.slow
@pytest.mark.parametrize("warm_checkpointing", [False, True])
def test_the_simulated_card_measures_what_the_emulated_gpu_does(
    warm_checkpointing: bool,
) -> None:
    """The mlp on a MIG slice whose allocator gets 64 MiB once the step's kernels and handles
    are loaded (the cuBLAS workspaces, 18.25 MiB for two threads, inside it), and the emulated
    GPU of that card: the warm-up and trials of both modes, fitting and running out, the same
    peaks reserved and allocated and retries. Before the emulated warm-up allocated each
    thread's workspaces at its first matmul, as the card does, and before later trials started
    from the warm-up's placement, the peaks allocated differed (by 608 KiB at 70 MiB)."""
    gpu, sms, capacity_bytes = find_gpu("A100 80GB"), 14, 64 * MiB
    with SimulatedCuda(gpu, mig=MigSlice("calibration", 2**34, sms)) as cuda:
        InProcessRunner(MLP, CudaDevice(0, runtime=cuda)).warm_up(checkpointing=False)
        outside_bytes = cuda.outside_allocator_bytes
    sizes = (1, 512, 2048, 4096)
    modes = [(checkpointing, b) for checkpointing in (False, True) for b in sizes]
    with SimulatedCuda(gpu, mig=MigSlice("card", capacity_bytes + outside_bytes, sms)) as cuda:
        card = InProcessRunner(MLP, CudaDevice(0, runtime=cuda))
        on_card = [_figures(card.warm_up(checkpointing=warm_checkpointing))]
        assert card.device_info.capacity_bytes == capacity_bytes
        on_card += [_figures(card.trial(b, checkpointing=c)) for c, b in modes]
    # The card as the emulated GPU: its allocator's capacity with both threads' workspaces in
    # it, and no kernel workspace kept free (the simulated card takes none).
    full = budget_for(gpu)
    budget = dataclasses.replace(
        full,
        gpu=dataclasses.replace(
            gpu, total_memory_bytes=capacity_bytes + full.reserve.outside_allocator_bytes
        ),
        reserve=full.reserve.model_copy(update={"kernel_workspace_bytes": 0}),
    )
    emulated = InProcessRunner(MLP, EmulatedDevice(gpu=budget))
    assert emulated.device_info.capacity_bytes == capacity_bytes
    on_emulated = [_figures(emulated.warm_up(checkpointing=warm_checkpointing))]
    on_emulated += [_figures(emulated.trial(b, checkpointing=c)) for c, b in modes]
    assert on_emulated == on_card
    # The warm-up fits; both modes fit at 1 and run out from 512 on, after retrying.
    assert [f[0] for f in on_card] == [True, *[True, False, False, False] * 2]
    assert [f[3] for f in on_card[2:5]] == [1, 1, 1]
