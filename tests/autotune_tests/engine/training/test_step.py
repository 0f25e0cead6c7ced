"""The training-step kernel: exact gradient accumulation, every precision and optimizer, undo."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from autotune.core.errors import SpecError
from autotune.core.schemas import (
    OptimizerName,
    Phase,
    Precision,
    Spec,
    TrainingSpec,
    WeightsDtype,
)
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.devices.simulated_cuda import SimulatedCuda
from autotune.engine.runner import InProcessRunner
from autotune.engine.training.step import TrainingStep, accumulate_gradients
from autotune.engine.training.workload import Batch, Workload
from tests.autotune_tests.engine.simulated_gpus import small_gpu
from tests.autotune_tests.factories import (
    TINY_LLAMA,
    padded_lm,
    tiny_classifier_without_checkpointing,
    tiny_lm,
)

CPU = torch.device("cpu")
HUGE_BYTES = 1 << 40
# Very different lengths, so that per-micro-batch token counts differ a lot: this is where the
# mean-of-means normalisation goes wrong.
LENGTHS = [3, 29, 5, 24, 2, 9, 31, 12]
RTOL, ATOL = 1e-5, 1e-6


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _micro_batches(micro_batch: int) -> tuple[Workload, list[Batch]]:
    workload, _ = padded_lm(LENGTHS)
    count = len(LENGTHS) // micro_batch
    return workload, [workload.make_batch(micro_batch, CPU) for _ in range(count)]


def _mean_of_means(workload: Workload, batches: list[Batch]) -> None:
    """The pre-October-2024 normalisation: each micro-batch by its own count, then by G."""
    for batch in batches:
        loss = workload.loss_sum(workload.model, batch) / workload.num_items(batch)
        torch.autograd.backward(loss / len(batches))


@pytest.mark.parametrize("micro_batch", [1, 2, 4])
def test_accumulated_gradient_equals_the_full_batch_gradient(micro_batch: int) -> None:
    full, full_batches = _micro_batches(len(LENGTHS))
    full_loss = accumulate_gradients(full.model, full.loss_sum, full.num_items, full_batches)
    expected = _grads(full.model)

    accum, batches = _micro_batches(micro_batch)
    # Padding differs: each micro-batch is padded only to its own longest sample.
    assert {b["input_ids"].shape[1] for b in batches} != {full_batches[0]["input_ids"].shape[1]}
    loss = accumulate_gradients(accum.model, accum.loss_sum, accum.num_items, batches)
    torch.testing.assert_close(loss, full_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(_grads(accum.model), expected, rtol=RTOL, atol=ATOL)

    _mean_of_means(accum, batches)
    naive = _grads(accum.model)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(naive, expected, rtol=RTOL, atol=ATOL)


def test_run_applies_the_full_batch_gradient() -> None:
    """End to end through run(): SGD's first momentum buffer is exactly the step's gradient."""
    training = TrainingSpec(optimizer=OptimizerName.SGD)
    momenta = []
    losses = []
    for micro_batch, steps in [(8, 1), (2, 4)]:
        workload, pool = padded_lm(LENGTHS)
        step = TrainingStep(workload, training, CPU)
        losses.append(step.run(micro_batch, accumulation_steps=steps))
        assert pool.cursor == len(LENGTHS)
        momenta.append(
            [step.optimizer.state[p]["momentum_buffer"] for p in step.model.parameters()]
        )
    assert losses[1] == pytest.approx(losses[0], rel=RTOL)
    torch.testing.assert_close(momenta[1], momenta[0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("precision", "optimizer"), list(itertools.product(Precision, OptimizerName))
)
def test_run_trains_in_every_precision_and_optimizer(
    precision: Precision, optimizer: OptimizerName
) -> None:
    torch.manual_seed(0)
    training = TrainingSpec(seq_len=16, precision=precision, optimizer=optimizer)
    step = TrainingStep(tiny_lm(training), training, CPU)
    before = [p.detach().clone() for p in step.model.parameters()]
    loss = step.run(micro_batch=2, accumulation_steps=2)
    assert loss == pytest.approx(torch.log(torch.tensor(TINY_LLAMA.vocab_size)).item(), rel=0.2)
    assert all(p.grad is None for p in step.model.parameters())
    changed = [not torch.equal(b, p) for b, p in zip(before, step.model.parameters(), strict=True)]
    assert all(changed)
    assert all(p.dtype == torch.float32 for p in step.model.parameters())  # fp32 master weights
    assert (step.scaler is not None) == (precision is Precision.FP16)


def test_bf16_weights_keep_no_fp32_copy() -> None:
    """weights: bf16 holds parameters, gradients and AdamW's moments in bf16: half the resident
    bytes of fp32 master weights, and still training."""
    resident_bytes = {}
    for weights in WeightsDtype:
        torch.manual_seed(0)
        training = TrainingSpec(seq_len=16, precision=Precision.BF16, weights=weights)
        step = TrainingStep(tiny_lm(training), training, CPU)
        before = [p.detach().clone() for p in step.model.parameters()]
        step.run(micro_batch=2)
        changed = [
            not torch.equal(b, p) for b, p in zip(before, step.model.parameters(), strict=True)
        ]
        # In bf16 an update under half a unit in the last place is lost (norm weights of 1.0
        # at lr 1e-4): the known cost of training without a master copy.
        assert all(changed) if weights is WeightsDtype.FP32 else sum(changed) > len(changed) / 2
        dtype = torch.bfloat16 if weights is WeightsDtype.BF16 else torch.float32
        assert all(p.dtype == dtype for p in step.model.parameters())
        moments = [s["exp_avg"] for s in step.optimizer.state.values()]
        assert moments and all(m.dtype == dtype for m in moments)
        step.model.zero_grad()  # gradients as a step leaves them: none
        resident_bytes[weights] = sum(
            t.numel() * t.element_size()
            for t in step.resident_tensors()
            if t.is_floating_point() and t.dim() > 0  # AdamW's step counters stay fp32
        )
    assert resident_bytes[WeightsDtype.BF16] * 2 == resident_bytes[WeightsDtype.FP32]


def test_checkpointing_toggles_the_model_and_keeps_the_loss() -> None:
    training = TrainingSpec(optimizer=OptimizerName.SGD)
    losses = []
    for checkpointing in (False, True):
        workload, _ = padded_lm(LENGTHS, preset=TINY_LLAMA)
        step = TrainingStep(workload, training, CPU)
        step.checkpointing = checkpointing
        assert step.model.gradient_checkpointing is checkpointing
        losses.append(step.run(4, accumulation_steps=2))
    assert losses[1] == pytest.approx(losses[0], rel=RTOL)


def test_checkpointing_is_a_spec_error_when_the_workload_cannot() -> None:
    training = TrainingSpec(input_shape=(8,))
    step = TrainingStep(tiny_classifier_without_checkpointing(training), training, CPU)
    step.checkpointing = False  # turning it off is always fine
    with pytest.raises(SpecError, match="checkpointing"):
        step.checkpointing = True
    assert step.checkpointing is False
    assert step.run(4) > 0


def test_resident_tensors_are_params_buffers_and_optimizer_state() -> None:
    torch.manual_seed(0)
    training = TrainingSpec(seq_len=8, precision=Precision.FP16)
    step = TrainingStep(tiny_lm(training), training, CPU)
    step.run(2)
    resident = {t.data_ptr() for t in step.resident_tensors()}
    params = list(step.model.parameters())
    assert {p.data_ptr() for p in params} <= resident
    for p in params:
        state = step.optimizer.state[p]
        assert {state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr()} <= resident
    assert step.scaler is not None and step.scaler._scale is not None
    assert step.scaler._scale.data_ptr() in resident
    # Gradients exist only mid-step; the list includes them then.
    loss = step.model(torch.zeros(1, 4, dtype=torch.int64)).sum()
    torch.autograd.backward(loss)
    with_grads = {t.data_ptr() for t in step.resident_tensors()}
    assert all(p.grad is not None and p.grad.data_ptr() in with_grads for p in params)
    step.clear_grads()
    assert all(p.grad is None for p in params)


def _state(step: TrainingStep) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    params = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    optimizer = [
        {k: v.clone() for k, v in step.optimizer.state[p].items() if isinstance(v, torch.Tensor)}
        for p in step.model.parameters()
    ]
    return params, optimizer


@pytest.mark.parametrize("optimizer", list(OptimizerName))
def test_restore_undoes_steps_exactly(optimizer: OptimizerName) -> None:
    torch.manual_seed(0)
    training = TrainingSpec(seq_len=8, optimizer=optimizer, precision=Precision.FP16)
    step = TrainingStep(tiny_lm(training), training, CPU)
    step.run(2)  # creates the optimizer and scaler state
    snapshot = step.snapshot()
    saved = _state(step)
    scale = step.scaler.get_scale() if step.scaler else None
    for _ in range(2):
        step.run(2)
        assert not torch.equal(_state(step)[0]["lm_head.weight"], saved[0]["lm_head.weight"])
        step.restore(snapshot)
        params, state = _state(step)
        torch.testing.assert_close(params, saved[0], rtol=0, atol=0)
        torch.testing.assert_close(state, saved[1], rtol=0, atol=0)
        assert step.scaler is not None and step.scaler.get_scale() == scale
    # The restored optimizer still steps (its state is live again, not the snapshot's).
    step.run(2)
    step.restore(snapshot)
    torch.testing.assert_close(_state(step)[1], saved[1], rtol=0, atol=0)


def test_a_snapshot_is_host_memory_not_the_device_s() -> None:
    # On the simulated GPU, device tensors are CPU tensors too: the snapshot's copies must not
    # count as device memory, as they do not on a card.
    with SimulatedCuda(small_gpu()) as cuda:
        training = TrainingSpec(seq_len=8)
        step = TrainingStep(tiny_lm(training), training, CPU)
        step.run(2)
        allocated_bytes = cuda.memory_allocated(0)
        snapshot = step.snapshot()
        assert cuda.memory_allocated(0) == allocated_bytes
        del snapshot


def test_an_out_of_memory_inside_the_scaled_optimizer_step_leaves_the_next_step_unharmed() -> None:
    """Review item 8 of issue 9: `scaler.step()` marks the optimizer UNSCALED before
    `optimizer.step()` runs out of memory, and only `update()` would forget it; the next trial
    in the process then stepped with gradients still multiplied by the scale."""
    spec = Spec.model_validate(
        {
            "model": {"factory": "tests.autotune_tests.factories:tiny_lm"},
            "training": {"seq_len": 8, "precision": "fp16"},
        }
    )

    def runner() -> InProcessRunner:
        torch.manual_seed(0)
        session = InProcessRunner(spec, EmulatedDevice(HUGE_BYTES, model_allocator=False))
        assert session.warm_up().fits
        return session

    failed, fresh = runner(), runner()
    peaks = fresh.trial(2).phase_peak_bytes  # AdamW's temporaries make the optimizer the peak
    assert peaks[Phase.OPTIMIZER] > max(peaks[Phase.FORWARD], peaks[Phase.BACKWARD])
    fresh = runner()
    tight = EmulatedDevice(peaks[Phase.OPTIMIZER] - 512, model_allocator=False)
    roomy, failed.device = failed.device, tight
    outcome = failed.trial(2)
    assert not outcome.fits and outcome.oom_phase is Phase.OPTIMIZER
    failed.device = roomy
    for session in (failed, fresh):
        torch.manual_seed(1)
        assert session.trial(2).fits
    failed_params, _ = _state(failed.step)
    fresh_params, _ = _state(fresh.step)
    torch.testing.assert_close(failed_params, fresh_params, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (OptimizerName.ADAMW, (torch.optim.AdamW, {"lr": 1e-4, "foreach": True})),
        (OptimizerName.SGD, (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9, "foreach": True})),
        (OptimizerName.ADAFACTOR, (torch.optim.Adafactor, {"lr": 1e-3, "foreach": True})),
    ],
)
def test_the_optimizer_is_built_as_a_gpu_run_builds_it(
    optimizer: OptimizerName, expected: tuple[type, dict[str, object]]
) -> None:
    # foreach: CUDA's default, whose temporaries count (the CPU's default is a loop).
    training = TrainingSpec(seq_len=8, optimizer=optimizer)
    step = TrainingStep(tiny_lm(training), training, CPU)
    kind, settings = expected
    assert type(step.optimizer) is kind
    group = step.optimizer.param_groups[0]
    assert {key: group[key] for key in settings} == settings


@pytest.mark.parametrize(("tf32", "expected"), [(True, "tf32"), (False, "ieee")])
def test_tf32_sets_torchs_matmul_and_convolution_precision(tf32: bool, expected: str) -> None:
    matmul = torch.backends.cuda.matmul.fp32_precision
    conv = torch.backends.cudnn.conv.fp32_precision  # type: ignore[attr-defined]
    try:
        training = TrainingSpec(seq_len=8, tf32=tf32)
        TrainingStep(tiny_lm(training), training, CPU)
        assert torch.backends.cuda.matmul.fp32_precision == expected
        assert torch.backends.cudnn.conv.fp32_precision == expected  # type: ignore[attr-defined]
    finally:
        torch.backends.cuda.matmul.fp32_precision = matmul
        torch.backends.cudnn.conv.fp32_precision = conv  # type: ignore[attr-defined]


def test_a_step_starts_without_checkpointing_and_refuses_empty_sizes() -> None:
    training = TrainingSpec(seq_len=8)
    workload = tiny_lm(training)
    assert workload.set_checkpointing is not None
    workload.set_checkpointing(True)  # as a model might come
    step = TrainingStep(workload, training, CPU)
    assert step.model.gradient_checkpointing is False and step.checkpointing is False
    for sizes in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match=r"must be >= 1, got \d and \d"):
            step.run(*sizes)


def test_one_item_is_divided_by_one() -> None:
    workload, _ = padded_lm(LENGTHS)
    batch = workload.make_batch(1, CPU)
    loss = accumulate_gradients(workload.model, workload.loss_sum, lambda _: 1, [batch])
    assert loss == pytest.approx(workload.loss_sum(workload.model, batch).item())


def test_restore_takes_only_a_snapshot() -> None:
    training = TrainingSpec(seq_len=8)
    step = TrainingStep(tiny_lm(training), training, CPU)
    with pytest.raises(TypeError, match="expected a StateSnapshot, got dict"):
        step.restore({})


def test_restore_puts_the_gradient_scale_back_and_needs_none_before_the_first_step() -> None:
    torch.manual_seed(0)
    training = TrainingSpec(seq_len=8, precision=Precision.FP16)
    step = TrainingStep(tiny_lm(training), training, CPU)
    early = step.snapshot()  # no scale exists yet: nothing to put back, and no error
    step.restore(early)
    step.run(2)
    snapshot = step.snapshot()
    assert step.scaler is not None
    scale = step.scaler.get_scale()
    step.scaler.update(new_scale=scale / 4)  # what an overflow does to it
    step.restore(snapshot)
    assert step.scaler.get_scale() == scale
