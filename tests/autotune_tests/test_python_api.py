"""`autotune.probe`, `autotune.tune` and `autotune.estimate` from a script
(autotune/python_api.py): a live transformers module gives the same maxima as the spec of its
config, is left as it was passed, and the result says the trials ran in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autotune
from autotune.core.errors import SpecError
from autotune.core.schemas import Sharding, SpeedSource
from autotune.python_api import LIVE_ASSUMPTION
from tests.autotune_tests.core.exports.roundtrip import tiny_llama
from tests.autotune_tests.factories import TINY_LLAMA_CONFIG

MEMORY_BYTES = 64 * 2**20
SEQ_LEN = 32


def example_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, TINY_LLAMA_CONFIG["vocab_size"], (2, SEQ_LEN))
    return {"input_ids": ids, "labels": ids.clone()}


def maxima(result: Any) -> dict[bool, int]:
    return {mode.checkpointing: mode.max_micro_batch for mode in result.modes}


@pytest.mark.e2e
def test_a_live_module_probes_as_its_spec_and_is_left_as_it_was() -> None:
    model = tiny_llama()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    live = autotune.probe(model=model, batch=example_batch(), memory=MEMORY_BYTES)
    spec = {"model": {"hf_config": TINY_LLAMA_CONFIG}, "training": {"seq_len": SEQ_LEN}}
    rebuilt = autotune.probe(spec, memory=MEMORY_BYTES)
    # The same step (tiled batch, the output's loss) holds what the rebuilt model's holds.
    assert maxima(live) == maxima(rebuilt)
    assert set(maxima(live)) == {False, True}
    assert LIVE_ASSUMPTION in live.device.assumptions
    assert LIVE_ASSUMPTION not in rebuilt.device.assumptions
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.e2e
def test_tune_a_live_module_with_its_exports() -> None:
    result = autotune.tune(
        model=tiny_llama(),
        batch=example_batch(),
        memory=MEMORY_BYTES,
        target_global_batch=8,
        trials=2,
        seconds_per_trial=0.05,
    )
    rec = result.recommendation
    assert rec is not None and rec.global_batch == 8
    assert result.exports is not None
    assert result.exports.hf["per_device_train_batch_size"] == rec.micro_batch
    assert LIVE_ASSUMPTION in result.device.assumptions


@pytest.mark.e2e
def test_estimate_takes_a_spec_dict() -> None:
    spec = {
        "model": {"preset": "gpt2-tiny"},
        "training": {"seq_len": 32, "target_global_batch": 8, "max_micro_batch": 8},
    }
    result = autotune.estimate(spec, gpu="T4", trials=1)
    assert result.recommendation is not None and result.recommendation.global_batch == 8
    assert result.device.name.startswith("estimate for T4")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "give a spec, or a model and an example batch"),
        ({"model": nn.Linear(2, 2)}, "batch: a live model needs one example batch"),
        (
            {"model": nn.Linear(2, 2), "batch": {"x": torch.ones(2, 2), "y": torch.ones(3)}},
            r"batch: every tensor needs the same batch size, got \[2, 3\]",
        ),
        ({"model": nn.Linear(2, 2), "batch": torch.ones(2, 2), "precision": "fp8"}, "precision"),
    ],
)
def test_wrong_arguments_are_refused_by_name(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        autotune.probe(memory=MEMORY_BYTES, **arguments)


def test_estimate_needs_a_spec() -> None:
    with pytest.raises(SpecError, match="estimate: needs a spec"):
        autotune.estimate(nn.Linear(2, 2), gpu="T4")  # type: ignore[arg-type]


def test_estimate_needs_a_process_at_least() -> None:
    with pytest.raises(ValueError, match="processes must be >= 1, got 0"):
        autotune.estimate({"model": {"preset": "mlp"}}, gpu="T4", processes=0)


@pytest.mark.e2e  # 28 s in a clean clone's make test: every layout estimated twice
def test_estimate_with_sharding_auto_chooses_the_fastest_of_the_layouts_estimated_alone(
    tmp_path: Path,
) -> None:
    """`sharding: auto` in the Python API runs every layout valid for the topology, as the tune
    command does (here two at a time, each in a process of its own): each layout's outcome is
    what estimating that layout alone gives, and the recommendation is the fastest's, naming
    it."""
    training = {
        "input_shape": [1024],
        "precision": "bf16",
        "world_size": 2,
        "target_global_batch": 8,
        "max_micro_batch": 4,
    }
    model = {"factory": "tests.autotune_tests.factories:linear_stack_4k"}
    auto = {"model": model, "training": {**training, "sharding": "auto"}}
    url = f"sqlite:///{tmp_path / 'auto.db'}"
    result = autotune.estimate(auto, gpu="T4", storage_url=url, processes=2)
    assert result.spec.training.sharding is Sharding.AUTO
    alone: dict[Sharding, float] = {}
    for layout in result.layouts:
        spec = {"model": model, "training": {**training, "sharding": layout.sharding.value}}
        url = f"sqlite:///{tmp_path / (layout.sharding.value + '.db')}"
        single = autotune.estimate(spec, gpu="T4", storage_url=url)
        assert single.recommendation is not None and layout.recommendation is not None
        assert single.recommendation.samples_per_s == layout.recommendation.samples_per_s
        alone[layout.sharding] = single.recommendation.samples_per_s
    assert set(alone) == {Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3}
    assert result.recommendation is not None
    fastest = max(alone, key=lambda sharding: alone[sharding])
    assert result.recommendation.sharding is fastest
    assert result.layouts[0].sharding is fastest
    assert result.exports is not None


@pytest.mark.e2e  # 15 s in a clean clone's make test: a tune per layout
def test_tune_with_sharding_auto_tunes_each_layout_on_its_own_emulated_ranks(
    tmp_path: Path,
) -> None:
    """On an emulated GPU of a bare size, each layout's ranks are emulated (CPU timings)."""
    spec = {
        "model": {"preset": "mlp"},
        "training": {"sharding": "auto", "world_size": 2, "target_global_batch": 8},
    }
    url = f"sqlite:///{tmp_path / 'auto.db'}"
    result = autotune.tune(
        spec, device="cpu", memory=2**30, storage_url=url, trials=2, seconds_per_trial=0.05
    )
    assert {layout.sharding for layout in result.layouts} == {
        Sharding.NONE,
        Sharding.ZERO1,
        Sharding.ZERO2,
        Sharding.ZERO3,
    }
    assert result.recommendation is not None
    assert result.recommendation.sharding is result.layouts[0].sharding
    assert result.device.name.startswith("emulated GPU")


def test_sharding_auto_with_a_live_module_is_refused_naming_the_field() -> None:
    """A live module is one object in this process: each layout would need a model of its own."""
    with pytest.raises(SpecError, match="training.sharding: auto"):
        autotune.tune(
            model=nn.Sequential(nn.Linear(4, 4)),
            batch=torch.zeros(2, 4),
            loss=lambda model, batch: model(batch).sum(),
            memory=2**30,
            sharding="auto",
            world_size=2,
            target_global_batch=8,
        )


def test_the_exports_set_the_allocator_settings_the_device_was_measured_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device whose CUDA starts with non-default allocator settings is measured under them
    (here `max_split_size_mb`, which keeps large blocks whole): every export sets them, or a
    training run started without them allocates otherwise (they were left out, as "the
    device's own")."""
    from autotune.core.exports import render_exports

    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:40")
    spec = {"model": {"preset": "mlp"}, "training": {"target_global_batch": 8}}
    result = autotune.tune(spec, device="cpu", memory=2**30, trials=1, seconds_per_trial=0.1)
    assert result.device.allocator_conf == "max_split_size_mb:40"
    assert result.exports is not None
    assert result.exports.allocator_conf == "max_split_size_mb:40"
    texts = render_exports(result.exports)
    assert "os.environ['PYTORCH_ALLOC_CONF'] = 'max_split_size_mb:40'" in texts["hf"]
    assert 'ALLOCATOR_CONF: str | None = "max_split_size_mb:40"' in texts["pytorch_loop"]


def test_a_specs_tune_on_a_named_gpu_is_timed_by_its_roofline(tmp_path: Path) -> None:
    """As the tune command: samples/s on an emulated T4 are the T4's, not this CPU's."""
    spec = {"model": {"preset": "mlp"}, "training": {"target_global_batch": 8}}
    url = f"sqlite:///{tmp_path / 't.db'}"
    result = autotune.tune(spec, gpu="T4", storage_url=url, trials=1, seconds_per_trial=0.05)
    assert result.device.speed is SpeedSource.ROOFLINE
    assert result.recommendation is not None
