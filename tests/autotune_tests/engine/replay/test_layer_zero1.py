"""The layer replay of ZeRO-1's ranks (autotune/engine/replay/layer_zero1.py): the deep rank's
share of
the parameters computed from a five-layer model's is torch's `ZeroRedundancyOptimizer`'s own,
and the trials replayed with the deep rank's optimizer events are the deep model's own traced
trials to the byte (peaks, phase peaks, out-of-memory and its detail, per-op live bytes,
allocation trace); its speed passes, timed from the five-layer model's kernels with the rank's
optimizer's over the deep partition, and its communication are the whole model's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autotune.core.schemas import Spec
from autotune.engine.emulation.layer_journal import NotReplayable
from autotune.engine.estimate import EstimateRunner
from autotune.engine.replay.layer_replay import TRACED_LAYERS, replay_depth
from autotune.engine.replay.layer_zero1 import (
    ParameterSize,
    PartitionBytes,
    deep_parameters,
    rank_share,
)
from autotune.engine.training.sharding import process_group, zero1_optimizer
from tests.autotune_tests.engine.replay import test_layer_replay as single_rank
from tests.autotune_tests.engine.replay.test_layer_replay_ddp import (
    _WIDE,
    _Decoder,
    every_trial_after_an_optimizer_out_of_memory_the_same,
)
from tests.autotune_tests.engine.replay.test_layer_replay_sharded import (
    A100,
    every_speed_pass_and_communication_the_same,
)
from tests.autotune_tests.engine.replay.test_layer_speed import every_partial_speed_pass_the_same

MiB = single_rank.MiB


def _sizes(model: _Decoder) -> list[ParameterSize]:
    layers = {id(p): index for index, layer in enumerate(model.layers) for p in layer.parameters()}
    return [
        ParameterSize(p.numel(), p.numel() * p.element_size(), layers.get(id(p)))
        for p in model.parameters()
    ]


@pytest.mark.parametrize(
    ("depth", "width", "ranks"), [(7, 64, 2), (12, 96, 4), (20, 64, 8), (9, 48, 3)]
)
def test_the_deep_share_is_the_deep_optimizers_own(depth: int, width: int, ranks: int) -> None:
    with torch.device("meta"):
        # One dtype, as ZeroRedundancyOptimizer needs (fp32 master weights, or LoRA's adapters).
        shallow, deep = _Decoder(TRACED_LAYERS, width).float(), _Decoder(depth, width).float()
    process_group(ranks)
    optimizer = zero1_optimizer(list(deep.parameters()), torch.optim.SGD, lr=0.1)
    numbers = {id(p): n for n, p in enumerate(deep.parameters())}
    local = tuple(numbers[id(p)] for p in optimizer.optim.param_groups[0]["params"])  # type: ignore[attr-defined]
    share = rank_share(deep_parameters(_sizes(shallow), TRACED_LAYERS, depth), ranks)
    assert share.local == local
    assert share.parameter_count == len(numbers)
    # The share is no repetition of the shallow model's layers: some layer's parameters the
    # rank updates differ from another's.
    sizes = _sizes(deep)
    by_layer = [
        tuple(sizes[n].nbytes for n in share.local if sizes[n].layer == layer)
        for layer in range(depth)
    ]
    assert len(set(by_layer)) > 1


def test_layers_that_differ_are_not_replayed() -> None:
    with torch.device("meta"):
        shallow = _Decoder(TRACED_LAYERS, 64)
    sizes = _sizes(shallow)
    changed = [*sizes]
    middle = next(n for n, p in enumerate(sizes) if p.layer == 2)
    changed[middle] = ParameterSize(1, 4, 2)
    with pytest.raises(NotReplayable):
        deep_parameters(changed, TRACED_LAYERS, 9)


def _zero1(model_type: str, depth: int, ranks: int, *, lora: bool, **extra: Any) -> Spec:
    return single_rank._spec(
        single_rank._config(model_type, depth, **extra),
        lora=lora,
        world_size=ranks,
        sharding="zero1",
    )


def test_zero1_ranks_are_replayed() -> None:
    for ranks in (2, 8):
        assert replay_depth(_zero1("qwen2", 16, ranks, lora=False)) == 16


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model_type", "depth", "ranks", "lora", "capacity_mib"),
    [("llama", 8, 2, True, 20), ("qwen2", 9, 4, False, 32), ("llama", 7, 4, True, 16)]
    + [("llama", 12, 2, False, 48)],
)
def test_every_replayed_zero1_trial_is_the_whole_trace_to_the_byte(
    model_type: str, depth: int, ranks: int, lora: bool, capacity_mib: int
) -> None:
    # Out-of-memory trials too: a ZeRO-1 rank keeps its parameters, so the detail is replayed.
    spec = _zero1(model_type, depth, ranks, lora=lora)
    single_rank.every_trial_of_spec_the_same(spec, capacity_mib * MiB)


@pytest.mark.e2e
def test_a_first_step_that_runs_out_in_the_optimizer_is_the_whole_trace_to_the_byte() -> None:
    """At 240 MiB the warm-up (the first step) runs out making the rank's optimizer state;
    the trials after it start from the buckets DDP's reducer rebuilt between the steps."""
    spec = _zero1("llama", 8, 2, lora=False, **_WIDE)
    outcome = every_trial_after_an_optimizer_out_of_memory_the_same(spec, 240 * MiB)
    assert outcome.oom is not None and outcome.oom.optimizer_state_bytes > 0


@pytest.mark.e2e
def test_replayed_zero1_trials_of_wide_layers_are_the_whole_trace_to_the_byte() -> None:
    # Gradient buckets that span layers and outnumber the shallow model's, and an optimizer
    # state of some MiB per layer.
    single_rank.every_trial_of_spec_the_same(
        _zero1("llama", 10, 2, lora=False, **_WIDE), 640 * MiB
    )


def test_a_foreach_kernel_over_the_partition_moves_the_deep_partitions_bytes() -> None:
    sizes = [ParameterSize(n, 4 * n, None) for n in (48, 16, 32, 16, 8)]
    shallow = rank_share(sizes[:2], 1)
    assert shallow.local_numel == (48, 16)
    partition = PartitionBytes(shallow, rank_share(sizes, 1), 9)  # 120 elements
    same = PartitionBytes(shallow, shallow, 5)
    with torch.device("meta"):
        states = [torch.empty(48), torch.empty(16)]
        halves = [torch.empty(48, dtype=torch.bfloat16), torch.empty(16, dtype=torch.bfloat16)]
        scalar = torch.empty(())
        swapped = [torch.empty(16), torch.empty(48)]
        mixed = [torch.empty(48), torch.empty(16, dtype=torch.bfloat16)]
    # Each list over the partition (its dtype's bytes) scaled to the deep partition, any other
    # tensor as it is.
    assert partition.deep_bytes((states, scalar), {"other": halves}, [states]) == (
        4 * 120 + 4 + 2 * 120 + 4 * 120
    )
    assert same.deep_bytes((states, scalar), {"other": halves}, [states]) == (
        4 * 64 + 4 + 2 * 64 + 4 * 64
    )
    # No list over the partition: another length, other elements in its order, two dtypes.
    for other in (states[:1], swapped, mixed):
        assert partition.deep_bytes((other, scalar), {}, [other]) is None


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model_type", "depth", "ranks", "lora", "extra"),
    [("llama", 8, 4, True, {}), ("qwen2", 9, 2, False, {}), ("llama", 10, 8, False, _WIDE)],
)
def test_every_replayed_zero1_speed_pass_and_communication_is_the_whole_models(
    model_type: str, depth: int, ranks: int, lora: bool, extra: dict[str, int]
) -> None:
    """The rank's optimizer kernels timed with the deep partition's bytes (which no traced
    layer's give: the deep share is no repetition of the shallow one's layers)."""
    every_speed_pass_and_communication_the_same(
        _zero1(model_type, depth, ranks, lora=lora, **extra)
    )


@pytest.mark.e2e
def test_partial_checkpointing_zero1_speed_passes_replayed_are_the_whole_models() -> None:
    # The eight-layer model's own shares.
    spec = _zero1("llama", 10, 4, lora=True)
    replayed = EstimateRunner(spec, gpu=A100)
    whole = EstimateRunner(spec, gpu=A100, layer_replay=False)
    assert replayed.warm_up(checkpointing=True).fits and whole.warm_up(checkpointing=True).fits
    every_partial_speed_pass_the_same(replayed, whole, (1, 6), [(1, 1), (3, 7)])
    assert replayed._full is None
