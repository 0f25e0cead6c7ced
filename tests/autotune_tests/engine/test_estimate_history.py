"""A configuration's estimate is its own (autotune/engine/estimate.py): the step time of a plain
step after the checkpointed and partially checkpointed trials and speed passes a tune runs before
it is a fresh runner's, to rounding, whether the whole model is traced or a shallow one is
replayed at its depth; and a plain trial after checkpointed ones is a fresh runner's to the byte
(peaks, out-of-memory detail, series, allocation trace)."""

from __future__ import annotations

import pytest

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.schemas import Spec
from autotune.engine.estimate import EstimateRunner
from tests.autotune_tests.engine.replay.test_layer_replay import _config, _spec, _the_same
from tests.autotune_tests.factories import TINY_LLAMA_CONFIG

A100 = budget_for(find_gpu("A100 80GB"))
RELATIVE = 1e-12
MiB = 2**20


def _runner(depth: int) -> EstimateRunner:
    pytest.importorskip("transformers")
    training = {
        "seq_len": 16,
        "precision": "bf16",
        "weights": "bf16",
        "lora": {"r": 4, "target_modules": "all-linear"},
    }
    config = {**TINY_LLAMA_CONFIG, "num_hidden_layers": depth}
    spec = Spec.model_validate({"model": {"hf_config": config}, "training": training})
    return EstimateRunner(spec, gpu=A100)


# Each runner traces some ten steps: seconds on a tiny model.
@pytest.mark.e2e
@pytest.mark.parametrize(("depth", "replayed"), [(2, False), (7, True)])
def test_a_plain_step_is_timed_the_same_after_checkpointed_ones(
    depth: int, replayed: bool
) -> None:
    fresh = _runner(depth)
    assert fresh.layer_replay is replayed
    assert fresh.warm_up().fits
    plain_s = fresh.step_time_s(1, 4)

    # As a tune runs them: the checkpointed mode's warm-up, then its trials and measurements
    # one after another (each turns checkpointing on again, while it is on), partial
    # checkpointing's too, then the plain mode. Before, each such turn left the hook
    # transformers puts on the input embeddings in place for good: the plain step computed the
    # first layer's input gradient too (6.5 % of the two-layer step's time).
    toured = _runner(depth)
    assert toured.warm_up(checkpointing=True).fits
    assert toured.trial(2, checkpointing=True).fits
    assert toured.measure(1, 4, checkpointing=True, target_seconds=0.0) is not None
    partial = toured.measure(1, 4, checkpointing=True, checkpointed_blocks=1, target_seconds=0.0)
    assert partial is not None
    assert toured.warm_up().fits
    assert toured.step_time_s(1, 4) == pytest.approx(plain_s, rel=RELATIVE)


# Two runners of some five traced steps each: seconds on a tiny model.
@pytest.mark.e2e
def test_a_plain_trial_is_traced_the_same_after_checkpointed_ones() -> None:
    # The estimate answers a trial traced before from its first trace, and the layer replay
    # keeps its journals by shallow step, on the rule that after the warm-up a step starts
    # from the same state whatever ran before (docs/design.md#the-layer-replay). Before
    # 121f37f two checkpointed trials in a row (the G = 2 probe's in the checkpointed mode)
    # left transformers' input-embedding hook on for good, and a later plain step kept the
    # first layer's input gradient's tensors: the same peak, but another series and
    # allocation trace, and where it ran out another op and cache (a 4 x 64 trial of an
    # 8-layer LoRA Llama at 12 MiB: 162,816 cached bytes where a fresh runner has 88,064).
    pytest.importorskip("transformers")
    spec = _spec(_config("llama", 2), lora=True)
    fresh = EstimateRunner(spec, capacity_bytes=6 * MiB)
    toured = EstimateRunner(spec, capacity_bytes=6 * MiB)
    assert not fresh.layer_replay  # two layers: the whole model is traced
    _the_same(fresh.warm_up(), toured.warm_up())
    assert toured.trial(1, 2, checkpointing=True).fits
    assert toured.trial(2, 2, checkpointing=True).fits
    fits = set()
    for micro_batch in (2, 4):
        outcome = fresh.trial(micro_batch, 64)
        _the_same(toured.trial(micro_batch, 64), outcome)
        fits.add(outcome.fits)
    assert fits == {True, False}  # one fits (series compared), one runs out (its detail)
