"""The estimate's layer replay (autotune/engine/replay/layer_replay.py): a deep decoder's
trials built
from a five-layer model's journal (an eight-layer one's under partial checkpointing) are the
deep model's own traced trials to the byte (peaks, out-of-memory and its detail, per-op live
bytes, allocation trace), and whatever the replay cannot vouch for is traced whole."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from autotune.core.schemas import Spec, StepOutcome
from autotune.engine.estimate import EstimateRunner
from autotune.engine.probe import probe_session
from autotune.engine.replay.layer_replay import TRACED_LAYERS, replay_depth

pytest.importorskip("transformers")

MiB = 2**20


def _config(model_type: str, depth: int, **extra: Any) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": depth,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        **extra,
    }


def _spec(config: dict[str, Any], *, lora: bool, **training: Any) -> Spec:
    settings: dict[str, Any] = {"precision": "bf16", "seq_len": 128, "max_micro_batch": 64}
    if lora:
        settings.update(weights="bf16", lora={"r": 8, "target_modules": "all-linear"})
    settings.update(training)
    return Spec.model_validate({"model": {"hf_config": config}, "training": settings})


def _the_same(replayed: StepOutcome, traced: StepOutcome) -> None:
    assert replayed == traced  # peaks, retries, phase peaks, out-of-memory and its detail
    assert replayed.series == traced.series
    assert replayed.allocations == traced.allocations


# (micro-batch, accumulation, checkpointing): sizes that fit and sizes that run out of the
# capacity below, in both modes, and accumulations of 2 and 3 micro-steps.
TRIALS = [(1, 1, False), (2, 1, True), (4, 3, False), (8, 1, True), (16, 1, False), (3, 2, True)]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model_type", "depth", "lora", "capacity_bytes"),
    # (Deeper models, of 10 and 12 layers: the partial checkpointing cases below.)
    [("llama", 8, True, 20 * MiB), ("qwen2", 9, False, 32 * MiB)],
)
def test_every_replayed_trial_is_the_whole_trace_to_the_byte(
    model_type: str, depth: int, lora: bool, capacity_bytes: int
) -> None:
    spec = _spec(_config(model_type, depth), lora=lora)
    replayed = EstimateRunner(spec, capacity_bytes=capacity_bytes)
    traced = EstimateRunner(spec, capacity_bytes=capacity_bytes, layer_replay=False)
    assert replayed.layer_replay and not traced.layer_replay
    assert replayed.num_blocks == traced.num_blocks == depth
    every_trial_the_same(replayed, traced)


def every_trial_of_spec_the_same(spec: Spec, capacity_bytes: int) -> None:
    """`every_trial_the_same` for `spec` at `capacity_bytes`, replayed and traced whole."""
    replayed = EstimateRunner(spec, capacity_bytes=capacity_bytes)
    traced = EstimateRunner(spec, capacity_bytes=capacity_bytes, layer_replay=False)
    assert replayed.layer_replay and not traced.layer_replay
    every_trial_the_same(replayed, traced)


def every_trial_the_same(replayed: EstimateRunner, traced: EstimateRunner) -> None:
    """The warm-up and `TRIALS`, replayed and traced, are the same; some fit, some do not."""
    _the_same(replayed.warm_up(), traced.warm_up())
    fits = set()
    for micro_batch, accumulation, checkpointing in TRIALS:
        outcome = replayed.trial(micro_batch, accumulation, checkpointing=checkpointing)
        _the_same(outcome, traced.trial(micro_batch, accumulation, checkpointing=checkpointing))
        fits.add(outcome.fits)
    assert fits == {True, False}  # both kinds of trial were compared
    assert replayed.layer_replay  # and the replay went on after every one of them


@pytest.mark.e2e
def test_a_probe_replayed_finds_the_whole_traces_maxima_and_peaks() -> None:
    spec = _spec(_config("llama", 10), lora=True)
    maxima = []
    for replay in (True, False):
        runner = EstimateRunner(spec, capacity_bytes=40 * MiB, layer_replay=replay)
        result = probe_session(runner)
        assert runner.layer_replay is replay
        maxima.append(
            [
                (
                    m.checkpointing,
                    m.max_micro_batch,
                    [(a.micro_batch, a.peak_bytes) for a in m.attempts],
                )
                for m in result.modes
            ]
        )
    assert maxima[0] == maxima[1]
    assert all(mode[1] >= 2 for mode in maxima[0])


# (micro-batch, accumulation) at each count of checkpointed blocks: sizes that fit at some
# counts and run out at others (in the forward or the backward), an accumulation of 3.
PARTIAL_TRIALS = [(1, 1), (2, 3), (4, 1)]


def every_partial_trial_the_same(
    replayed: EstimateRunner,
    traced: EstimateRunner,
    blocks: Sequence[int],
    trials: Sequence[tuple[int, int]],
) -> None:
    """Each (micro-batch, accumulation) of `trials` at each count of checkpointed `blocks`,
    replayed and traced, is the same; some fit, some do not."""
    fits = set()
    for count in blocks:
        for micro_batch, accumulation in trials:
            outcome = replayed.trial(
                micro_batch, accumulation, checkpointing=True, checkpointed_blocks=count
            )
            whole = traced.trial(
                micro_batch, accumulation, checkpointing=True, checkpointed_blocks=count
            )
            _the_same(outcome, whole)
            fits.add(outcome.fits)
    assert fits == {True, False}  # both kinds of trial were compared
    # Every one of them was replayed (a failed replay stops for good), none traced whole.
    assert replayed.layer_replay and replayed.partial_replay


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model_type", "depth", "lora", "capacity_bytes", "blocks", "warm_checkpointing"),
    [
        # The edges: 1 and 2 blocks (no checkpointed middle layer, or one), N - 2 and N - 1
        # (one plain middle layer, or none), N (full checkpointing), and both runs repeated,
        # at 5 and 6 blocks from one shallow trace (the second written out from the first's).
        ("llama", 12, False, 13 * MiB, (1, 2, 5, 6, 11, 12), True),
        ("qwen2", 9, True, 16 * MiB, (1, 8), False),
        # As deep as the traced model: each layer its own template.
        ("llama", 8, True, 10 * MiB, (3, 7), True),
        ("qwen2", 10, False, 16 * MiB, (2, 9), False),
    ],
)
def test_every_partial_checkpointing_trial_replayed_is_the_whole_trace_to_the_byte(
    model_type: str,
    depth: int,
    lora: bool,
    capacity_bytes: int,
    blocks: tuple[int, ...],
    warm_checkpointing: bool,
) -> None:
    spec = _spec(_config(model_type, depth), lora=lora)
    replayed = EstimateRunner(spec, capacity_bytes=capacity_bytes)
    traced = EstimateRunner(spec, capacity_bytes=capacity_bytes, layer_replay=False)
    warm = replayed.warm_up(checkpointing=warm_checkpointing)
    _the_same(warm, traced.warm_up(checkpointing=warm_checkpointing))
    assert warm.fits
    every_partial_trial_the_same(replayed, traced, blocks, PARTIAL_TRIALS)
    # ... and the trials the five-layer model replays are the whole trace's still.
    _the_same(replayed.trial(2, checkpointing=True), traced.trial(2, checkpointing=True))


@pytest.mark.e2e
def test_partial_checkpointing_of_a_model_shallower_than_its_traced_one_is_traced_whole() -> None:
    spec = _spec(_config("qwen2", 7), lora=True)
    replayed = EstimateRunner(spec, capacity_bytes=16 * MiB)
    traced = EstimateRunner(spec, capacity_bytes=16 * MiB, layer_replay=False)
    _the_same(replayed.warm_up(), traced.warm_up())
    for count in (1, 3, 6):
        _the_same(
            replayed.trial(4, checkpointing=True, checkpointed_blocks=count),
            traced.trial(4, checkpointing=True, checkpointed_blocks=count),
        )
    assert replayed.layer_replay and not replayed.partial_replay
    # No checkpointed block at all is no partial checkpointing either: refused as whole.
    for runner in (replayed, traced):
        with pytest.raises(ValueError, match="checkpointed blocks"):
            runner.trial(1, checkpointing=True, checkpointed_blocks=0)


def test_layers_that_differ_are_not_replayed() -> None:
    # Qwen2's sliding window on the layers from max_window_layers on: two kinds of layer.
    sliding = _config("qwen2", 8, use_sliding_window=True, sliding_window=32, max_window_layers=4)
    assert replay_depth(_spec(sliding, lora=True)) is None
    assert replay_depth(_spec(_config("qwen2", 8), lora=True)) == 8


def test_only_deep_transformers_configs_are_replayed() -> None:
    assert replay_depth(_spec(_config("llama", TRACED_LAYERS + 1), lora=True)) is None
    assert replay_depth(_spec(_config("llama", TRACED_LAYERS + 2), lora=True)) == 7
    # Several ranks: tests/autotune_tests/engine/replay/test_layer_replay_ddp.py,
    # test_layer_replay_sharded.py, test_layer_zero1.py.
    preset = Spec.model_validate({"model": {"preset": "llama-tiny"}, "training": {"seq_len": 16}})
    assert replay_depth(preset) is None
