"""The longest-sequence probe (autotune/engine/sequence_probe.py): on the emulated GPU and in an
estimate the same exact answer per mode, certified by trials (the answer fits, the next multiple
of the step does not), the cap and the step obeyed; refusals named."""

from __future__ import annotations

import pytest

from autotune.core.errors import SpecError
from autotune.core.schemas import SequenceProbeResult, Spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.estimate import EstimateRunner
from autotune.engine.runner import InProcessRunner, TrialRunner
from autotune.engine.sequence_probe import model_positions, probe_max_seq_len, sequence_trial
from tests.autotune_tests.factories import TINY_LLAMA_CONFIG

pytestmark = pytest.mark.slow

# Logits dominate this Llama's step at long sequences (vocabulary 8192, width 64): its peak at
# micro-batch 1 grows from 26 MiB at 64 tokens to 76 MiB at 512.
LONG_LLAMA = {**TINY_LLAMA_CONFIG, "vocab_size": 8192, "max_position_embeddings": 512}
CAPACITY_BYTES = 50 * 2**20


def _spec() -> Spec:
    return Spec.model_validate(
        {"model": {"hf_config": LONG_LLAMA}, "training": {"seq_len": 512, "precision": "bf16"}}
    )


def _emulated(spec: Spec) -> TrialRunner:
    return InProcessRunner(spec, EmulatedDevice(CAPACITY_BYTES))


def _estimated(spec: Spec) -> TrialRunner:
    return EstimateRunner(spec, capacity_bytes=CAPACITY_BYTES)


def _answers(result: SequenceProbeResult) -> list[tuple[bool, int]]:
    return [(mode.checkpointing, mode.max_seq_len) for mode in result.modes]


@pytest.mark.e2e
def test_the_estimate_and_the_emulated_gpu_find_the_same_certified_longest_sequence() -> None:
    pytest.importorskip("transformers")
    spec = _spec()
    estimated = probe_max_seq_len(spec, _estimated)
    assert estimated.cap_tokens == 512 and estimated.step_tokens == 64
    for mode in estimated.modes:
        assert 0 < mode.max_seq_len < 512 and mode.max_seq_len % 64 == 0
        verdicts = {a.seq_len: a.fits for a in mode.attempts}
        assert verdicts[mode.max_seq_len] and verdicts[mode.max_seq_len + 64] is False
        assert len(verdicts) == len(mode.attempts)  # no length twice
    # Checkpointing keeps less: never a shorter answer.
    assert estimated.modes[1].max_seq_len >= estimated.modes[0].max_seq_len
    # The emulated GPU runs the steps: the same answers (the estimate agrees by construction).
    emulated = probe_max_seq_len(spec, _emulated, modes=(False,))
    assert _answers(emulated) == _answers(estimated)[:1]
    assert emulated.device.capacity_bytes == CAPACITY_BYTES


@pytest.mark.e2e
def test_a_larger_micro_batch_and_a_stated_step_are_obeyed() -> None:
    pytest.importorskip("transformers")
    spec = _spec()
    result = probe_max_seq_len(
        spec, _estimated, micro_batch=2, step_tokens=100, cap_tokens=450, modes=(False,)
    )
    (mode,) = result.modes
    assert result.micro_batch == 2 and result.cap_tokens == 450
    assert all(a.seq_len % 100 == 0 and a.seq_len <= 450 for a in mode.attempts)
    # At 2 samples per step the longest that fits is shorter than at 1, and it is exact.
    longest = mode.max_seq_len
    assert 0 < longest <= 400
    at, _ = sequence_trial(
        spec.with_training({"seq_len": longest}), _estimated, micro_batch=2, checkpointing=False
    )
    past, _ = sequence_trial(
        spec.with_training({"seq_len": longest + 100}),
        _estimated,
        micro_batch=2,
        checkpointing=False,
    )
    assert at.fits and not past.fits


def test_what_has_no_sequence_or_no_known_length_is_refused_by_name() -> None:
    mlp = Spec.model_validate({"model": {"preset": "mlp"}})
    with pytest.raises(SpecError, match="fixed-shape inputs"):
        probe_max_seq_len(mlp, _estimated)
    factory = Spec.model_validate(
        {
            "model": {"factory": "tests.autotune_tests.factories:tiny_lm"},
            "training": {"seq_len": 16},
        }
    )
    assert model_positions(factory) is None
    with pytest.raises(SpecError, match="--seq-cap"):
        probe_max_seq_len(factory, _estimated)
    with pytest.raises(SpecError, match="below one step"):
        probe_max_seq_len(_spec(), _estimated, cap_tokens=32)
    assert model_positions(_spec()) == 512
    llama = Spec.model_validate({"model": {"preset": "llama-tiny"}})
    assert model_positions(llama) == 256
