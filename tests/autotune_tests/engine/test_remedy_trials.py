"""What would make it fit, verified (autotune/engine/remedy_trials.py): a tiny Llama that fits
nowhere on a small emulated GPU gets every change that makes it fit, each of which fits when the
changed spec runs on the emulated GPU; the fewest GPUs are the fewest; a shorter sequence is the
longest that fits; what does not apply or does not fit is said."""

from __future__ import annotations

import pytest

from autotune.core.remedies import LORA_RANK, MAX_WORLD_SIZE, NOT_MODELLED_OFFLOAD, sharded_change
from autotune.core.schemas import DeviceInfo, DeviceKind, Spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.estimate import EstimateRunner, estimate_device
from autotune.engine.probe import probe_session
from autotune.engine.remedy_trials import (
    SameGpu,
    find_fit_advice,
    fits_nowhere,
    shorter_sequence,
    verify,
)
from autotune.engine.runner import InProcessRunner
from autotune.engine.sequence_probe import sequence_trial
from tests.autotune_tests.engine.test_sequence_probe import LONG_LLAMA

pytestmark = pytest.mark.slow

# llama-tiny holds 7.4M parameters: 118 MB of fp32 weights, gradients and AdamW states, more
# than this GPU; its activations at 64 tokens are a few MiB.
CAPACITY_BYTES = 100 * 2**20
ONE_GPU = SameGpu(None, CAPACITY_BYTES)


def _spec() -> Spec:
    return Spec.model_validate(
        {"model": {"preset": "llama-tiny"}, "training": {"seq_len": 64, "precision": "bf16"}}
    )


@pytest.mark.e2e  # some twenty traced steps and a real step per remedy: minutes on 2 cores
def test_every_change_that_makes_it_fit_fits_on_the_emulated_gpu() -> None:
    spec = _spec()
    assert fits_nowhere(probe_session(EstimateRunner(spec, capacity_bytes=CAPACITY_BYTES)))
    advice = find_fit_advice(spec, ONE_GPU)
    assert {r.change for r in advice.remedies} == {
        "bf16 weights",
        f"LoRA rank {LORA_RANK} on all linear layers",
        "8-bit AdamW",
        "2 GPUs with ZeRO-3 (FSDP full shard)",
    }
    # The weights alone are past the capacity: no length helps, and pairs are not needed.
    assert advice.still_too_large == ["any sequence of 64 tokens or more"]
    assert advice.not_modelled == [NOT_MODELLED_OFFLOAD]
    for remedy in advice.remedies:
        changed = spec.with_training(remedy.spec_diff)
        assert changed.training.world_size == remedy.world_size
        runner = InProcessRunner(changed, EmulatedDevice(CAPACITY_BYTES))
        outcome = runner.warm_up(checkpointing=remedy.checkpointing)
        assert outcome.fits, remedy.change
        outcome = runner.trial(1, checkpointing=remedy.checkpointing)
        # The emulated GPU runs the changed step: the traced peak to the byte.
        assert (outcome.fits, outcome.peak_bytes) == (True, remedy.peak_bytes), remedy.change
        assert remedy.capacity_bytes == CAPACITY_BYTES and remedy.samples_per_s is None


@pytest.mark.e2e
def test_a_shorter_sequence_is_the_longest_that_fits_at_one_sample() -> None:
    pytest.importorskip("transformers")
    spec = Spec.model_validate(
        {"model": {"hf_config": LONG_LLAMA}, "training": {"seq_len": 512, "precision": "bf16"}}
    )
    gpu = SameGpu(None, 50 * 2**20)
    remedy = shorter_sequence(spec, gpu, 64)
    assert remedy is not None and remedy.seq_len is not None
    assert remedy.spec_diff == {"seq_len": remedy.seq_len} and remedy.seq_len < 512
    assert remedy.change == f"sequence {remedy.seq_len} tokens"
    longer = spec.with_training({"seq_len": remedy.seq_len + 64})
    for checkpointing in (False, True):
        outcome, _ = sequence_trial(longer, gpu.runner, micro_batch=1, checkpointing=checkpointing)
        assert not outcome.fits


def test_the_same_gpu_is_the_named_card_when_there_is_one() -> None:
    named = SameGpu.of(estimate_device("A100 80GB"))
    assert named.gpu_name == "A100 80GB"
    bare = SameGpu.of(EmulatedDevice(CAPACITY_BYTES).info)
    assert bare == ONE_GPU
    card = DeviceInfo(
        kind=DeviceKind.CUDA, name="NVIDIA H100 80GB HBM3", total_memory_bytes=1, capacity_bytes=1
    )
    assert SameGpu.of(card).gpu_name == "H100 80GB"  # nvidia-smi's name, in the catalogue


class _CountingGpu(SameGpu):
    """The same GPU, listing the world size of every runner built."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(None, capacity_bytes)
        object.__setattr__(self, "built", [])

    def runner(self, spec: Spec) -> EstimateRunner:
        self.built.append(spec.training.world_size)  # type: ignore[attr-defined]
        return super().runner(spec)


def test_a_change_is_verified_in_both_modes_on_one_runner() -> None:
    """40 MiB hold llama-tiny on 2 ranks in neither mode: both traced on one runner (the
    model built once), not one each."""
    gpu = _CountingGpu(40 * 2**20)
    assert verify(_spec(), sharded_change(2, MAX_WORLD_SIZE), gpu) is None
    assert gpu.built == [2]  # type: ignore[attr-defined]
