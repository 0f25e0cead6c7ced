"""`sharding: auto` at the tuner's level (autotune/engine/layout_tuning.py): every layout valid
for the topology is tuned on fake tensors on a named GPU, and the ranking flips where it should:
DDP first when it fits on NVLink, full shard when only it fits, hybrid ahead of full shard when
the network between nodes is slow; every loser says why, refusals name their field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.parallel.layout_choice import layout_candidates
from autotune.core.schemas import LayoutOutcome, LayoutVerdict, Sharding, Spec, TuneResult
from autotune.core.tuning.result_check import check_result
from autotune.engine.estimate import EstimateRunner
from autotune.engine.layout_tuning import tune_layouts
from autotune.engine.probe import FitTracer
from autotune.engine.runner import TrialRunner


def _estimate(gpu: str) -> Any:
    def open_layout(spec: Spec) -> tuple[TrialRunner, FitTracer | None]:
        budget = budget_for(find_gpu(gpu), spec.training.world_size)
        return EstimateRunner(spec, gpu=budget), None

    return open_layout


def _tune(spec: Spec, tmp_path: Path) -> TuneResult:
    url = f"sqlite:///{tmp_path / 't.db'}"
    result = tune_layouts(spec, _estimate("H100 80GB"), storage_url=url)
    assert check_result(spec, result) == []
    return result


def _stack(factory: str, width: int, **training: Any) -> Spec:
    settings = {
        "input_shape": [width],
        "precision": "bf16",
        "sharding": "auto",
        "max_micro_batch": 4,
        **training,
    }
    model = {"factory": f"tests.autotune_tests.factories:{factory}"}
    return Spec.model_validate({"model": model, "training": settings})


def _by_layout(result: TuneResult) -> dict[Sharding, LayoutOutcome]:
    return {layout.sharding: layout for layout in result.layouts}


@pytest.mark.e2e
@pytest.mark.slow
def test_ddp_first_when_it_fits_on_nvlink(tmp_path: Path) -> None:
    """67M parameters fit whole: DDP's layouts all-reduce once per optimizer step of 32
    micro-steps, the sharded layouts gather and reduce-scatter every micro-step. Which of
    DDP's two is first is AdamW's: its foreach step reads and writes some 21 fp32 copies of the
    parameters, which ZeRO-1 cuts to an eighth (2.4 ms of a 9 ms step at 8 micro-steps, where
    ZeRO-2's 16-bit weights without casts come first by 0.6 %)."""
    spec = _stack("linear_stack_4k", 4096, world_size=8, target_global_batch=1024)
    result = _tune(spec, tmp_path)
    layouts = _by_layout(result)
    assert set(layouts) == {Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3}
    assert set(list(layouts)[:2]) == {Sharding.NONE, Sharding.ZERO1}
    assert result.recommendation is not None
    chosen = result.recommendation.sharding
    assert chosen is list(layouts)[0]
    assert result.layouts[0].verdict is LayoutVerdict.CHOSEN
    ddp_speed = result.recommendation.samples_per_s
    for sharding in {Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3} - {chosen}:
        loser = layouts[sharding]
        assert loser.verdict is LayoutVerdict.SLOWER
        assert loser.recommendation is not None
        assert loser.recommendation.samples_per_s < ddp_speed
        assert loser.reason.startswith("fits but ") and " % slower" in loser.reason
    # The sharded layouts lose to their exposed all-gathers, and the reasons say so.
    assert "of exposed parameter all-gather" in layouts[Sharding.ZERO2].reason
    assert "of exposed parameter all-gathers" in layouts[Sharding.ZERO3].reason
    # What the result shows and exports is the chosen layout's, per GPU and for the job.
    assert result.exports is not None
    assert result.exports.training.sharding is chosen
    stage = result.exports.deepspeed.get("zero_optimization", {}).get("stage", 0)
    assert stage == (1 if chosen is Sharding.ZERO1 else 0)
    assert result.recommendation.job_samples_per_s == pytest.approx(8 * ddp_speed)


@pytest.mark.e2e
@pytest.mark.slow
def test_full_shard_when_only_it_fits(tmp_path: Path) -> None:
    """25.8B parameters in fp32 with AdamW: only full sharding over 8 H100s holds them."""
    spec = _stack("linear_stack_32k_deep", 32768, world_size=8, target_global_batch=32)
    result = _tune(spec, tmp_path)
    layouts = _by_layout(result)
    assert result.recommendation is not None
    assert result.recommendation.sharding is Sharding.ZERO3
    assert result.layouts[0].sharding is Sharding.ZERO3
    assert result.layouts[0].reason.startswith("the only layout that hits the target")
    assert result.exports is not None
    assert result.exports.deepspeed["zero_optimization"]["stage"] == 3
    for sharding in (Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2):
        assert layouts[sharding].verdict is LayoutVerdict.DOES_NOT_FIT
        assert layouts[sharding].reason.startswith("does not fit: micro-batch 1 runs out")
        assert layouts[sharding].recommendation is None


@pytest.mark.e2e
@pytest.mark.slow
def test_hybrid_ahead_of_full_shard_when_the_network_is_slow(tmp_path: Path) -> None:
    """Two nodes at 50 Gb/s: full shard gathers every block across the network every
    micro-step, hybrid gathers within the node and all-reduces only gradient shards across."""
    spec = _stack(
        "linear_stack_32k",
        32768,
        nodes=2,
        gpus_per_node=8,
        inter_node_gbps=50,
        target_global_batch=64,
    )
    assert layout_candidates(spec.training)[-1] is Sharding.HYBRID
    result = _tune(spec, tmp_path)
    layouts = _by_layout(result)
    hybrid, full = layouts[Sharding.HYBRID], layouts[Sharding.ZERO3]
    assert hybrid.recommendation is not None and full.recommendation is not None
    assert result.recommendation == hybrid.recommendation
    assert result.recommendation.sharding is Sharding.HYBRID
    assert hybrid.shard_group_size == 8
    assert full.verdict is LayoutVerdict.SLOWER
    assert full.recommendation.samples_per_s < hybrid.recommendation.samples_per_s
    assert full.exposed_communication_s is not None and hybrid.exposed_communication_s is not None
    assert full.exposed_communication_s > hybrid.exposed_communication_s
    assert "of exposed parameter all-gathers" in full.reason
    assert result.exports is not None
    assert result.exports.training.shard_group_size == 8


def test_auto_with_a_shard_group_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="training.shard_group_size: only for sharding: hybrid"):
        Spec.model_validate(
            {
                "model": {"preset": "mlp"},
                "training": {
                    "world_size": 8,
                    "sharding": "auto",
                    "shard_group_size": 4,
                    "target_global_batch": 8,
                },
            }
        )


def test_auto_on_one_node_has_no_hybrid_and_one_rank_only_ddp() -> None:
    training = {"sharding": "auto", "target_global_batch": 8}
    one_node = Spec.model_validate(
        {"model": {"preset": "mlp"}, "training": {**training, "world_size": 8}}
    )
    assert Sharding.HYBRID not in layout_candidates(one_node.training)
    alone = Spec.model_validate({"model": {"preset": "mlp"}, "training": training})
    assert layout_candidates(alone.training) == [Sharding.NONE]


def test_auto_without_a_target_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="training.sharding: auto chooses the layout by"):
        Spec.model_validate(
            {"model": {"preset": "mlp"}, "training": {"world_size": 2, "sharding": "auto"}}
        )
