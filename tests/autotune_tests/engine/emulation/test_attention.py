"""Attention on the emulated GPU keeps for backward what a GPU's fused kernel keeps
(autotune/engine/emulation/attention.py): the same values and gradients as torch's own attention,
the dropout mask of forward reused in backward, and no s x s tensor saved, for the zoo and HF GPT-2
(whose dropout sends CPU attention down the math path)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from autotune.core.schemas import Precision, Spec
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.emulation.attention import fused_attention, gpu_attention
from autotune.engine.emulation.tracker import LiveBytesTracker
from autotune.engine.runner import InProcessRunner

MiB = 2**20


def _qkv(batch: int = 2, heads: int = 4, seq: int = 16, head_dim: int = 8) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(batch, heads, seq, head_dim, generator=generator, requires_grad=True)
        for _ in range(3)
    ]


def _grads(attend: Callable[..., torch.Tensor], **kwargs: object) -> list[torch.Tensor]:
    q, k, v = _qkv()
    weights = torch.linspace(-1, 1, 8)
    (attend(q, k, v, **kwargs) * weights).sum().backward()
    return [t.grad for t in (q, k, v) if t.grad is not None]


CAUSAL = torch.ones(16, 16, dtype=torch.bool).tril()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"is_causal": True},
        {"attn_mask": CAUSAL},
        {"attn_mask": torch.zeros(2, 1, 16, 16).masked_fill(~CAUSAL, float("-inf"))},
        {"scale": 0.5},
    ],
    ids=["plain", "causal", "bool-mask", "additive-mask", "scale"],
)
def test_values_and_gradients_equal_torchs_attention(kwargs: dict[str, object]) -> None:
    q, k, v = _qkv()
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(fused_attention(q, k, v, **kwargs), expected)  # type: ignore[arg-type]
    for ours, theirs in zip(
        _grads(fused_attention, **kwargs),
        _grads(F.scaled_dot_product_attention, **kwargs),
        strict=True,
    ):
        torch.testing.assert_close(ours, theirs)


def test_backward_reuses_the_dropout_mask_of_forward() -> None:
    # With value = identity, the output is the dropped-out attention matrix P itself; the
    # gradient of sum(out * w) with respect to value is then P^T @ w, which only the same mask
    # in backward reproduces.
    seq = 16
    q, k, _ = _qkv(seq=seq, head_dim=seq)
    value = torch.eye(seq).expand(2, 4, seq, seq).clone().requires_grad_()
    weights = torch.randn(seq, seq, generator=torch.Generator().manual_seed(1))
    dropped = fused_attention(q, k, value, dropout_p=0.5)
    assert (dropped == 0).float().mean() > 0.3  # dropout took place
    (dropped * weights).sum().backward()
    assert value.grad is not None
    torch.testing.assert_close(value.grad, dropped.detach().transpose(-2, -1) @ weights)


def test_shapes_a_gpu_runs_on_the_math_path_are_left_alone() -> None:
    q, k, v = _qkv(head_dim=12)  # not a multiple of 8: no fused CUDA kernel either
    with _saved_shapes() as shapes, gpu_attention():
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).sum()
    assert (2, 4, 16, 16) in shapes


@contextlib.contextmanager
def _saved_shapes() -> Iterator[list[tuple[int, ...]]]:
    """Shapes of the tensors forward saves for backward (what stays alive until backward)."""
    shapes: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # Backward's own recomputation saves too, but frees it within the op.
        if torch._C._current_graph_task_id() == -1:
            shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield shapes


def _square(shapes: list[tuple[int, ...]], seq: int) -> list[tuple[int, ...]]:
    return [s for s in shapes if len(s) == 4 and s[-2:] == (seq, seq)]


SEQ = 128


def _hf_gpt2_spec(precision: Precision = Precision.FP32) -> Spec:
    # HF GPT-2 trains with attention dropout 0.1, which CPU attention runs on the math path.
    return Spec.model_validate(
        {
            "model": {
                "hf_config": {
                    "model_type": "gpt2",
                    "n_layer": 2,
                    "n_embd": 64,
                    "n_head": 4,
                    "vocab_size": 128,
                    "n_positions": SEQ,
                }
            },
            "training": {"precision": precision.value, "seq_len": SEQ, "max_micro_batch": 64},
        }
    )


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_hf_gpt2_on_the_emulated_gpu_saves_no_attention_matrix(precision: Precision) -> None:
    runner = InProcessRunner(_hf_gpt2_spec(precision), EmulatedDevice(512 * MiB))
    runner.warm_up()
    with _saved_shapes() as shapes:
        assert runner.trial(2).fits
    assert shapes, "the step saved nothing for backward"
    assert not _square(shapes, SEQ)

    # The same step outside the emulated device keeps one s x s matrix per layer (and the
    # dropout mask): the memory the fused kernels never allocate.
    with _saved_shapes() as shapes:
        runner.step.run(2, 1)
    assert len(_square(shapes, SEQ)) >= 2


def test_hf_gpt2_with_attention_dropout_checkpoints_on_the_emulated_gpu() -> None:
    # Recomputation in backward ran the CPU's attention, whose math path (dropout) saves other
    # tensors than the fused kernel: checkpoint raised CheckpointError on every such model.
    runner = InProcessRunner(_hf_gpt2_spec(), EmulatedDevice(512 * MiB))
    assert runner.warm_up(checkpointing=True).fits
    with _saved_shapes() as shapes:
        assert runner.trial(2, checkpointing=True).fits
    assert not _square(shapes, SEQ)


def _tracked_peak_bytes(runner: InProcessRunner, micro_batch: int, *, fused: bool) -> int:
    tracker = LiveBytesTracker(None)
    tracker.add_resident(runner.step.resident_tensors())
    with gpu_attention() if fused else contextlib.nullcontext(), tracker:
        runner.step.run(micro_batch, 1)
    return tracker.peak_bytes


def test_the_tracked_peak_drops_by_the_attention_matrices() -> None:
    runner = InProcessRunner(_hf_gpt2_spec(), EmulatedDevice(512 * MiB))
    runner.warm_up()
    unfused_bytes = _tracked_peak_bytes(runner, 4, fused=False)
    fused_bytes = _tracked_peak_bytes(runner, 4, fused=True)
    # Per layer the math path keeps the fp32 weights and the bool dropout mask; 2 layers,
    # micro-batch 4, 4 heads. (Some of it may be freed before the peak: ask for half.)
    matrices_bytes = 2 * 4 * 4 * SEQ * SEQ * (4 + 1)
    assert unfused_bytes - fused_bytes >= matrices_bytes // 2
    # What the emulated device reports is the fused figure.
    trial = runner.trial(4)
    assert trial.series is not None and max(trial.series) == fused_bytes


def _backward_allocations(dtype: torch.dtype, mask: torch.Tensor | None) -> list[int]:
    """The backward's allocation events (sizes; -(i + 1) frees the i-th), numbered from 0."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 200, 40, generator=generator).to(dtype).requires_grad_()
        for _ in range(3)
    )
    output = fused_attention(q, k, v, attn_mask=mask)
    grad_output = torch.ones_like(output)
    tracker = LiveBytesTracker(None, record_series=True)
    tracker.add_resident([q, k, v, output.detach(), grad_output])
    first = len(tracker.allocations)
    with tracker:
        grads = torch.autograd.grad(output, (q, k, v), grad_output)
    assert len(grads) == 3
    return [e if e >= 0 else e + first for e in tracker.allocations[first:]]


# (2, 4, 200, 40) in 16 bits: 128,000 bytes per gradient.
GRAD_BYTES = 2 * 4 * 200 * 40 * 2


def test_flash_backward_allocates_the_gradients_then_its_scratch_and_frees_the_scratch() -> None:
    # flash_api.cpp's mha_bwd, by hand: softmax_d is (2, 4, 256) fp32 and dq_accum is
    # (2, 256, 4, 64) fp32 (seq 200 rounded to 128s, head 40 to 32s); both die with the op,
    # the gradients outlive it.
    events = _backward_allocations(torch.bfloat16, None)
    assert events == [GRAD_BYTES] * 3 + [8_192, 524_288, -5, -4]


def test_masked_or_fp32_attention_counts_the_efficient_kernels_scratch() -> None:
    # delta (2, 4, 200) fp32; the dQ workspace estimate (2, 4, 256, 64) fp32.
    events = _backward_allocations(torch.bfloat16, torch.zeros(200, 200))
    assert events == [GRAD_BYTES] * 3 + [6_400, 524_288, -5, -4]
    fp32_events = _backward_allocations(torch.float32, None)
    assert fp32_events == [2 * GRAD_BYTES] * 3 + [6_400, 524_288, -5, -4]


def _scaled_block(**kwargs: object) -> Callable[..., torch.Tensor]:
    # Query and key scaled differently: swapped in backward, their gradients differ.
    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q * 2, k * 3, v * 5, **kwargs)  # type: ignore[arg-type]

    return block


def _checkpointed(block: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(block, q, k, v, use_reentrant=False)
        return out

    return run


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"is_causal": True},
        {"attn_mask": CAUSAL},
        {"attn_mask": torch.zeros(2, 1, 16, 16).masked_fill(~CAUSAL, -1e9)},
    ],
    ids=["plain", "causal", "bool-mask", "additive-mask"],
)
@pytest.mark.parametrize("entry", ["Tensor.backward", "autograd.grad"])
def test_checkpointed_attention_has_the_gradients_of_eager_attention(
    kwargs: dict[str, object], entry: str
) -> None:
    # Checkpoint recomputes in backward, where a function mode is not active by itself: the
    # CPU's attention recomputed there saved the key where forward had saved the query, and
    # checkpoint hands saved tensors back by position (the gradients of q and k were wrong).
    eager = _grads(_scaled_block(**kwargs))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        loss = (_checkpointed(_scaled_block(**kwargs))(q, k, v) * torch.linspace(-1, 1, 8)).sum()
        if entry == "autograd.grad":
            return list(torch.autograd.grad(loss, (q, k, v)))
        loss.backward()
        return [t.grad for t in (q, k, v) if t.grad is not None]

    with gpu_attention():
        grads = attend(*_qkv())
    assert len(grads) == 3
    for ours, theirs in zip(grads, eager, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_checkpoint_recomputes_the_dropout_mask_of_forward() -> None:
    # Recomputation restores torch's RNG state; the fused kernel's seed must come from it, or
    # the recomputed attention drops other positions than the output forward returned.
    def grads(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(7)
        block = _scaled_block(dropout_p=0.5)
        with gpu_attention():
            return _grads(_checkpointed(block) if checkpointed else block)

    plain = grads(checkpointed=False)
    assert plain[2].abs().sum() > 0
    for ours, theirs in zip(grads(checkpointed=True), plain, strict=True):
        torch.testing.assert_close(ours, theirs)
