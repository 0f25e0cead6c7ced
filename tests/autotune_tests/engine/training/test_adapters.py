"""LoRA adapters (training.lora) built with peft: frozen parameters get no gradients and no
optimizer state, the probe is exact on top, and the estimate traces the same step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autotune.core.errors import SpecError
from autotune.core.schemas import Spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.estimate import EstimateRunner
from autotune.engine.probe import probe
from autotune.engine.runner import InProcessRunner
from autotune.engine.training.adapters import adapter_parameter_ids, trainable_parameter_count
from tests.autotune_tests.factories import TINY_LLAMA_CONFIG


@pytest.fixture(autouse=True)
def _peft() -> None:
    # Imported by the test that needs it: at collection, every worker would pay for it.
    pytest.importorskip("peft")


MiB = 2**20
HUGE_BYTES = 2**40


def _spec(**training: object) -> Spec:
    return Spec.model_validate(
        {
            "model": {"preset": "llama-tiny"},
            "training": {"seq_len": 32, "max_micro_batch": 64, **training},
        }
    )


def _state_bytes(runner: InProcessRunner) -> int:
    return sum(
        value.numel() * value.element_size()
        for state in runner.step.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def test_frozen_parameters_get_no_gradient_and_no_optimizer_state() -> None:
    full = InProcessRunner(_spec(), EmulatedDevice(HUGE_BYTES))
    lora = InProcessRunner(_spec(lora={"r": 8}), EmulatedDevice(HUGE_BYTES))
    for runner in (full, lora):
        assert runner.warm_up().fits  # one step: the optimizer state exists from here on
    model = lora.step.model
    trainable = trainable_parameter_count(model)
    total = sum(p.numel() for p in model.parameters())
    assert 0 < trainable < 0.05 * total
    assert {id(p) for p in model.parameters() if p.requires_grad} == adapter_parameter_ids(model)
    # AdamW keeps 8 bytes per trainable parameter (and a step counter each): far less state.
    assert _state_bytes(lora) < 0.05 * _state_bytes(full)
    assert _state_bytes(lora) == pytest.approx(8 * trainable, rel=0.01)
    # Backward leaves gradients on the adapters only.
    lora.step.model.zero_grad(set_to_none=True)
    batch = lora.workload.make_batch(2, torch.device("cpu"))
    loss = lora.workload.loss_sum(model, batch)
    torch.autograd.backward(loss)
    assert all((p.grad is not None) is p.requires_grad for p in model.parameters())


@pytest.mark.e2e
@pytest.mark.slow
def test_the_probe_is_exact_on_a_lora_spec() -> None:
    spec = _spec(lora={"r": 8, "dropout": 0.1})
    result = probe(spec, EmulatedDevice(100 * MiB))
    for mode in result.modes:
        best = mode.max_micro_batch
        assert 1 <= best < spec.training.max_micro_batch
        # Exact: a fresh model on a fresh device runs `best` and runs out at best + 1.
        fresh = InProcessRunner(spec, EmulatedDevice(100 * MiB))
        assert fresh.warm_up(checkpointing=mode.checkpointing).fits
        assert fresh.trial(best, checkpointing=mode.checkpointing).fits
        assert not fresh.trial(best + 1, checkpointing=mode.checkpointing).fits


@pytest.mark.e2e
def test_the_estimate_traces_a_lora_step_to_the_byte() -> None:
    spec = _spec(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    estimate = EstimateRunner(spec, capacity_bytes=HUGE_BYTES)
    emulated = InProcessRunner(spec, EmulatedDevice(HUGE_BYTES))
    for checkpointing in (False, True):
        a = estimate.trial(3, checkpointing=checkpointing)
        b = emulated.trial(3, checkpointing=checkpointing)
        assert (a.peak_bytes, a.peak_allocated_bytes, a.series, a.allocations) == (
            b.peak_bytes,
            b.peak_allocated_bytes,
            b.series,
            b.allocations,
        )


def test_a_bf16_base_keeps_fp32_adapters() -> None:
    spec = _spec(lora={"r": 8}, precision="bf16", weights="bf16")
    runner = InProcessRunner(spec, EmulatedDevice(HUGE_BYTES))
    assert runner.warm_up().fits
    model = runner.step.model
    adapters = adapter_parameter_ids(model)
    for param in model.parameters():
        expected = torch.float32 if id(param) in adapters else torch.bfloat16
        assert param.dtype == expected


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"target_modules": ["no_such_proj"]}, "training.lora.target_modules: Target modules"),
        ({"modules_to_save": ["no_head"]}, "training.lora.modules_to_save: no module named"),
    ],
)
def test_adapters_the_model_does_not_have_are_refused_by_field(
    lora: dict[str, object], message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        InProcessRunner(_spec(lora=lora), EmulatedDevice(HUGE_BYTES))


def _hf_lora_runner() -> InProcessRunner:
    pytest.importorskip("transformers")
    spec = Spec.model_validate(
        {
            "model": {"hf_config": TINY_LLAMA_CONFIG},
            "training": {"seq_len": 16, "lora": {"r": 4}},
        }
    )
    return InProcessRunner(spec, EmulatedDevice(HUGE_BYTES))


def test_lora_on_a_hugging_face_model_adapts_its_linear_layers_but_the_head() -> None:
    runner = _hf_lora_runner()
    assert runner.trial(2).fits
    trainable = {n for n, p in runner.step.model.named_parameters() if p.requires_grad}
    # Seven projections per layer (q, k, v, o, gate, up, down), an A and a B each.
    assert len(trainable) == 2 * 7 * 2
    assert not any("lm_head" in name or "embed_tokens" in name for name in trainable)


def test_a_plain_step_after_a_checkpointed_one_is_the_plain_step() -> None:
    # transformers hooks the input embeddings when checkpointing is enabled (so that gradients
    # reach the first checkpointed layer of a frozen base) and leaves the hook when it is
    # disabled on a model peft wrapped from outside: every later plain step then also computed
    # the first layer's input gradient. Turned on while on (a trial after a checkpointed one),
    # it hooked them again and kept only the newest hooks to remove.
    runner = _hf_lora_runner()
    inputs_carry_gradients: list[bool] = []

    def first_layer_input(_module: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs_carry_gradients.append(hidden.requires_grad)

    first_layer = runner.step.model.get_base_model().model.layers[0]
    first_layer.register_forward_pre_hook(first_layer_input, with_kwargs=True)
    before = runner.trial(2)
    assert runner.trial(2, checkpointing=True).fits
    assert runner.trial(2, checkpointing=True).fits
    after = runner.trial(2)
    assert inputs_carry_gradients == [False, True, True, False]
    assert after.peak_bytes == before.peak_bytes
