"""CUDA's autocast policy on the emulated GPU (`autotune.engine.emulation.autocast`).

The reference is torch's own CUDA autocast: its compiled kernels run on fake CUDA tensors on this
CPU-only build (`cuda_autocast_oracle`). Per op, the ops that run below autocast, with their
dtypes, must be the reference's; and the tensors autograd saves must have the dtypes the lists
give (docs/design.md#autocast-on-the-emulated-gpu).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError, checkpoint, set_checkpoint_early_stop

from autotune.core.presets import PRESETS, CNNPreset, DecoderPreset, MLPPreset
from autotune.core.schemas import Precision, Spec, TrainingSpec
from autotune.engine.emulation.attention import gpu_attention
from autotune.engine.emulation.autocast import (
    CUDA_POLICY,
    CastPolicy,
    cpu_listed_ops,
    cuda_autocast_policy,
    is_cuda_policy_active,
)
from autotune.engine.training.checkpointing import checkpoint_blocks
from autotune.engine.training.step import TrainingStep
from autotune.engine.training.workload import IGNORE_INDEX, Batch, Workload, build_workload
from autotune.engine.training.zoo import build_model

from .cuda_autocast_oracle import (
    ops_registered_for,
    saved_by_node,
    saved_dtypes,
    trace_on_emulated_gpu,
    trace_on_fake_cuda,
)

LOW_DTYPES = [torch.bfloat16, torch.float16]

# ---------------------------------------------------------------------------------------------
# The lists.


def test_the_policy_covers_exactly_the_ops_torch_registers_for_cuda_autocast() -> None:
    assert set(CUDA_POLICY) == ops_registered_for("AutocastCUDA")


def test_cpu_listed_ops_are_the_binarys_autocast_cpu_registrations() -> None:
    listed = cpu_listed_ops()
    assert listed == ops_registered_for("AutocastCPU")
    # What the issue is about: CPU casts cross_entropy_loss as one op, CUDA lists it not at all.
    assert "cross_entropy_loss" in listed and "cross_entropy_loss" not in CUDA_POLICY
    assert "layer_norm" not in listed and CUDA_POLICY["layer_norm"] is CastPolicy.FP32


# ---------------------------------------------------------------------------------------------
# Per op: the trace below autocast equals torch's CUDA autocast; saved tensors as derived.

L = "L"  # the autocast dtype (bf16 or fp16) in the expectations below


@dataclass(frozen=True)
class OpCase:
    """`fn(*inputs)` with inputs given as (shape, "fp32" | "L" | "i64"); the expected output
    dtype and saved-for-backward dtypes on CUDA; whether torch's CPU lists run it otherwise."""

    name: str
    fn: Callable[..., Any]
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    output: str
    saved: dict[str, int]
    cpu_lists_differ: bool


def _inputs(case: OpCase, low: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for shape, kind in case.inputs:
        if kind == "i64":
            tensors.append(torch.randint(0, 4, shape, generator=generator))
        else:
            dtype = low if kind == L else torch.float32
            tensors.append(torch.randn(shape, generator=generator).to(dtype))
    return tensors


def _resolve(kind: str, low: torch.dtype) -> str:
    dtype = {L: low, "fp32": torch.float32, "i64": torch.int64, "int64": torch.int64}[kind]
    return str(dtype).removeprefix("torch.")


X = ((4, 8), L)  # a 16-bit activation
X32 = ((4, 8), "fp32")  # an fp32 activation (the residual stream, the loss input)
T = ((4,), "i64")  # class targets or indices

# Derivation: CUDA's lower_precision_fp ops (linear, matmul, bmm, baddbmm, addmm, conv, einsum)
# cast floating inputs to L, so the matrices their backward keeps are L; fp32 ops (layer_norm,
# rms_norm, group_norm, pow, exp, rsqrt, logsumexp, the losses) cast to fp32, so what they keep
# is fp32; fp32_set_opt_dtype ops (softmax, log_softmax, sum, cumsum, prod) compute in fp32 and
# return fp32; promote ops (addcmul) cast to the widest input; ops on no list (embedding, gelu,
# silu, relu, mean, batch_norm, max_pool2d, cat) run in their inputs' dtypes, by type promotion.
OP_CASES = [
    OpCase("linear", F.linear, (X32, ((6, 8), "fp32"), ((6,), "fp32")), L, {L: 2}, False),
    OpCase("linear_3d", F.linear, (((2, 4, 8), "fp32"), ((6, 8), "fp32")), L, {L: 2}, False),
    OpCase("matmul", torch.matmul, (((2, 4, 8), "fp32"), ((2, 8, 3), "fp32")), L, {L: 2}, False),
    OpCase("bmm", torch.bmm, (((2, 4, 8), "fp32"), ((2, 8, 3), "fp32")), L, {L: 2}, False),
    OpCase(
        "baddbmm",
        torch.baddbmm,
        (((2, 4, 3), "fp32"), ((2, 4, 8), "fp32"), ((2, 8, 3), "fp32")),
        L,
        {L: 2},
        False,
    ),
    OpCase("addmm", torch.addmm, (((4, 3), "fp32"), X32, ((8, 3), "fp32")), L, {L: 2}, False),
    OpCase(
        "conv2d",
        F.conv2d,
        (((2, 3, 8, 8), "fp32"), ((4, 3, 3, 3), "fp32"), ((4,), "fp32")),
        L,
        {L: 2},
        False,
    ),
    OpCase(
        "einsum",
        lambda a, b: torch.einsum("ij,jk->ik", a, b),
        (X32, ((8, 3), "fp32")),
        L,
        {L: 2},
        True,
    ),
    OpCase(
        "layer_norm",
        lambda x, w, b: F.layer_norm(x, (8,), w, b),
        (X, ((8,), "fp32"), ((8,), "fp32")),
        "fp32",
        {"fp32": 5},  # input, weight, bias, mean, rstd
        True,
    ),
    OpCase(
        "rms_norm",
        lambda x, w: F.rms_norm(x, (8,), w),
        (((2, 4, 8), L), ((8,), "fp32")),
        "fp32",
        {"fp32": 6},  # its fp32 parts: pow's input, rsqrt's result, the two products' inputs
        True,
    ),
    OpCase(
        "group_norm",
        lambda x, w, b: F.group_norm(x, 2, w, b),
        (((2, 4, 3), L), ((4,), "fp32"), ((4,), "fp32")),
        "fp32",
        {"fp32": 4},  # input, weight, mean, rstd
        True,
    ),
    OpCase("softmax", lambda x: F.softmax(x, -1), (X,), "fp32", {"fp32": 1}, True),
    OpCase("log_softmax", lambda x: F.log_softmax(x, -1), (X,), "fp32", {"fp32": 1}, True),
    OpCase("pow", lambda x: torch.pow(x, 3.0), (X,), "fp32", {"fp32": 1}, True),
    OpCase("exp", torch.exp, (X,), "fp32", {"fp32": 1}, True),
    OpCase("rsqrt", torch.rsqrt, (X,), "fp32", {"fp32": 1}, True),
    OpCase("sum", torch.sum, (X,), "fp32", {}, True),
    OpCase("cumsum", lambda x: torch.cumsum(x, 0), (X,), "fp32", {}, True),
    OpCase("logsumexp", lambda x: torch.logsumexp(x, -1), (X,), "fp32", {"fp32": 2}, True),
    OpCase(
        "norm",
        lambda x: torch.ops.aten.norm.Scalar(x, 2),
        (X,),
        "fp32",
        {L: 1, "fp32": 1},  # fp32_append_dtype sets the output dtype; the input stays L
        True,
    ),
    OpCase(
        "cross_entropy",
        F.cross_entropy,
        (((4, 10), L), T),
        "fp32",
        # Not on CUDA's lists: its parts run. log_softmax gets the logits' own dtype passed
        # explicitly, so it stays L (result kept); nll_loss casts to fp32 and keeps its input
        # and total weight (fp32) and the target. The CPU casts the whole loss to fp32.
        {L: 1, "fp32": 2, "int64": 1},
        True,
    ),
    OpCase("nll_loss", F.nll_loss, (((4, 10), L), T), "fp32", {"fp32": 2, "int64": 1}, False),
    OpCase("mse_loss", F.mse_loss, (X, X32), "fp32", {"fp32": 2}, False),
    OpCase("addcmul", torch.addcmul, (X, X32, X), "fp32", {"fp32": 2}, True),  # promote: all fp32
    OpCase("cat", lambda a, b: torch.cat([a, b]), (X32, X), "fp32", {}, True),
    OpCase("embedding", F.embedding, (T, ((10, 8), "fp32")), "fp32", {"int64": 1}, False),
    OpCase("gelu", lambda x: F.gelu(x, approximate="tanh"), (X,), L, {L: 1}, False),
    OpCase("silu", F.silu, (X,), L, {L: 1}, False),
    OpCase("relu", F.relu, (X,), L, {L: 1}, False),
    OpCase("mean", torch.mean, (X,), L, {}, False),
    OpCase(
        "batch_norm",
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        (((2, 3, 4, 4), L), ((3,), "fp32"), ((3,), "fp32")),
        L,
        {L: 1, "fp32": 3},  # input; weight, mean, invstd
        False,
    ),
    OpCase(
        "max_pool2d",
        lambda x: F.max_pool2d(x, 2),
        (((2, 3, 4, 4), L),),
        L,
        {L: 1, "int64": 1},
        False,
    ),
    OpCase(
        "sdpa",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        (((2, 2, 16, 8), "fp32"),) * 3,
        L,
        {L: 4, "fp32": 1},  # with gpu_attention: query, key, value, output; logsumexp
        False,
    ),
]


@pytest.mark.parametrize("low", LOW_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: c.name)
def test_op_runs_as_torchs_cuda_autocast_runs_it(case: OpCase, low: torch.dtype) -> None:
    tensors = _inputs(case, low)
    reference = trace_on_fake_cuda(case.fn, tensors, low)
    emulated = trace_on_emulated_gpu(case.fn, tensors, low)
    assert emulated == reference
    assert reference[-1][2][0] == _resolve(case.output, low)
    cpu_lists = trace_on_emulated_gpu(case.fn, tensors, low, policy=False)
    assert (cpu_lists != reference) == case.cpu_lists_differ


@pytest.mark.parametrize("low", LOW_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: c.name)
def test_op_saves_for_backward_the_dtypes_cuda_saves(case: OpCase, low: torch.dtype) -> None:
    # Attention runs as the emulated GPU runs it: as the fused kernel.
    context = gpu_attention() if case.name == "sdpa" else contextlib.nullcontext()
    with context:
        saved = saved_dtypes(case.fn, _inputs(case, low), low)
    assert saved == Counter({_resolve(k, low): n for k, n in case.saved.items()})


@pytest.mark.parametrize("low", LOW_DTYPES, ids=["bf16", "fp16"])
def test_binary_cross_entropy_is_refused_as_cuda_refuses_it(low: torch.dtype) -> None:
    probabilities, target = torch.rand(4), torch.rand(4)
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        trace_on_fake_cuda(F.binary_cross_entropy, [probabilities, target], low)
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        trace_on_emulated_gpu(F.binary_cross_entropy, [probabilities, target], low)
    # torch's CPU lists cast it to fp32 instead.
    trace_on_emulated_gpu(F.binary_cross_entropy, [probabilities, target], low, policy=False)


# ---------------------------------------------------------------------------------------------
# Scope: outside the context, torch's CPU lists are back.


def _layer_norm_dtype(x: torch.Tensor) -> torch.dtype:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.layer_norm(x, (8,)).dtype


def test_outside_the_context_cpu_autocast_is_torchs_own_again() -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    clear_autocast_cache = torch.clear_autocast_cache
    assert _layer_norm_dtype(x) == torch.bfloat16  # the CPU lists leave layer_norm alone
    with cuda_autocast_policy():
        assert is_cuda_policy_active()
        assert _layer_norm_dtype(x) == torch.float32
        with cuda_autocast_policy():  # nested entries share the registration
            assert _layer_norm_dtype(x) == torch.float32
        assert _layer_norm_dtype(x) == torch.float32
    assert not is_cuda_policy_active()
    assert _layer_norm_dtype(x) == torch.bfloat16
    assert torch.clear_autocast_cache is clear_autocast_cache
    # And every op's AutocastCPU kernel is torch's again: the same ops registered as before.
    assert ops_registered_for.__wrapped__("AutocastCPU") == cpu_listed_ops()


def test_the_context_is_left_clean_when_the_body_raises() -> None:
    with pytest.raises(ValueError), cuda_autocast_policy():
        raise ValueError("boom")
    assert not is_cuda_policy_active()
    assert _layer_norm_dtype(torch.randn(4, 8, dtype=torch.bfloat16)) == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# The cast cache: one cast per weight per autocast region, as torch's cached_cast.


class _Casts(TorchDispatchMode):  # type: ignore[misc]
    """Weak references to every tensor `_to_copy` makes (the casts autocast inserts)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            self.copies.append(weakref.ref(out))
        return out


def _count_casts(fn: Callable[[], object]) -> int:
    casts = _Casts()
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16), casts:
        fn()
    return len(casts.copies)


def test_a_weight_is_cast_once_per_autocast_region_whatever_uses_it() -> None:
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    # linear and einsum are both on CUDA's lower_precision_fp list: one cast of the weight (a
    # leaf that requires grad) serves both; x is cast each time.
    assert _count_casts(lambda: (F.linear(x, weight), torch.einsum("ij,kj->ik", x, weight))) == 3
    # Tensors that are not such leaves are cast on every use.
    hidden = weight * 2
    assert _count_casts(lambda: (F.linear(x, hidden), F.linear(x, hidden))) == 4


@pytest.mark.e2e
def test_the_cached_casts_die_when_the_outermost_autocast_region_exits() -> None:
    weight, x = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8)
    casts = _Casts()
    with cuda_autocast_policy(), torch.no_grad():  # no_grad: nothing keeps the cast for backward
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with casts:
                F.linear(x, weight)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pass
            gc.collect()
            assert [ref() is not None for ref in casts.copies] == [False, True]  # x's; weight's
        gc.collect()
        assert casts.copies[1]() is None


# ---------------------------------------------------------------------------------------------
# The zoo: every op of a forward and its loss runs as torch's CUDA autocast runs it, and what
# autograd saves has the dtypes derived from the lists.

ZOO = ["gpt2-tiny", "llama-tiny", "cnn", "mlp"]
SEQ = 16


def _zoo_inputs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    preset = PRESETS[name]
    generator = torch.Generator().manual_seed(0)
    if isinstance(preset, DecoderPreset):
        ids = torch.randint(0, preset.vocab_size, (2, SEQ), generator=generator)
        # The labels shifted as causal_lm_loss_sum shifts them (slicing a fake CUDA tensor
        # would abort, so it is done here).
        return ids, F.pad(ids, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
    shape = (2, *preset.input_shape)
    return torch.randn(shape, generator=generator), torch.randint(0, 10, (2,), generator=generator)


def _zoo_loss(model: torch.nn.Module, names: list[str]) -> Callable[..., torch.Tensor]:
    """The workload's forward and loss (autotune.engine.training.workload), on given parameters."""

    def loss(inputs: torch.Tensor, labels: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(model, dict(zip(names, state, strict=True)), inputs)
        return F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    return loss


@pytest.mark.parametrize("low", LOW_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_forward_runs_as_torchs_cuda_autocast_runs_it(name: str, low: torch.dtype) -> None:
    torch.manual_seed(0)
    model = build_model(PRESETS[name])
    if name == "cnn":
        # Training-mode BatchNorm updates its running statistics in place, which fake CUDA
        # tensors cannot; BatchNorm is on no autocast list, so eval mode casts the same.
        model.eval()
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    loss = _zoo_loss(model, list(state))
    tensors = [*_zoo_inputs(name), *state.values()]
    reference = trace_on_fake_cuda(loss, tensors, low)
    assert trace_on_emulated_gpu(loss, tensors, low) == reference
    assert len(reference) > 10


def _node(name: str, field: str, dtype: str, count: int) -> dict[tuple[str, str, str], int]:
    return {(name, field, dtype): count}


def _layer_norms(count: int) -> dict[tuple[str, str, str], int]:
    fields = ("input", "weight", "bias", "result1", "result2")  # result1/2: mean, rstd
    return {("NativeLayerNormBackward0", f, "fp32"): count for f in fields}


def _loss() -> dict[tuple[str, str, str], int]:
    # The loss runs on logits upcast to fp32: log_softmax keeps its fp32 result, nll_loss its
    # fp32 input and total weight and the int64 targets.
    return {
        ("LogSoftmaxBackward0", "result", "fp32"): 1,
        ("NllLossBackward0", "self", "fp32"): 1,
        ("NllLossBackward0", "total_weight", "fp32"): 1,
        ("NllLossBackward0", "target", "int64"): 1,
    }


def _expected_saved(name: str) -> dict[tuple[str, str, str], int]:
    """What a CUDA run saves, derived from the lists: linear/matmul/conv are lower_precision_fp
    (inputs and weights kept in L); layer_norm is fp32 (input, affine parameters, statistics in
    fp32); attention is lower_precision_fp (query, key, value, output in L; the kernels keep
    their logsumexp in fp32); gelu, silu, relu, max_pool2d, batch_norm, embedding and mul are on
    no list and keep what they get, in the dtype it comes in: L after a linear or conv, fp32 on
    the residual stream (which stays fp32: fp32 + L promotes to fp32), and fp32 for BatchNorm's
    parameters and statistics, and for RMSNorm, which Llama applies to the fp32 stream."""
    preset = PRESETS[name]
    if isinstance(preset, DecoderPreset) and preset.family == "gpt2":
        n = preset.n_layer
        return {
            **_node("AddmmBackward0", "mat1", L, 4 * n),  # c_attn, attn_proj, c_fc, mlp_proj
            **_node("AddmmBackward0", "mat2", L, 4 * n),
            **_node("GeluBackward0", "self", L, n),
            **_node("_FusedAttentionBackward", "saved_tensors", L, 4 * n),  # q, k, v, output
            **_node("_FusedAttentionBackward", "saved_tensors", "fp32", n),  # logsumexp
            **_layer_norms(2 * n + 1),  # ln_1, ln_2 per block, ln_f
            **_node("MmBackward0", "self", L, 1),  # lm_head (no bias: a matmul)
            **_node("MmBackward0", "mat2", L, 1),
            **_node("EmbeddingBackward0", "indices", "int64", 2),  # tokens, positions
            **_loss(),
        }
    if isinstance(preset, DecoderPreset):
        n, norms = preset.n_layer, 2 * preset.n_layer + 1  # attn_norm, mlp_norm per block; norm
        return {
            **_node("MmBackward0", "self", L, 7 * n + 1),  # q, k, v, o, gate, up, down; lm_head
            **_node("MmBackward0", "mat2", L, 7 * n + 1),
            # RMSNorm on the fp32 stream: x^2 keeps x, rsqrt its result, x * rsqrt and
            # weight * normalised keep both factors.
            **_node("PowBackward0", "self", "fp32", norms),
            **_node("RsqrtBackward0", "result", "fp32", norms),
            **_node("MulBackward0", "self", "fp32", 2 * norms),
            # Rotary: q * cos, k * cos, rot(q) * sin, rot(k) * sin keep the fp32 tables only.
            **_node("MulBackward0", "other", "fp32", 2 * norms + 4 * n),
            # SwiGLU: silu keeps its L input; silu(gate) * up keeps both L factors.
            **_node("SiluBackward0", "self", L, n),
            **_node("MulBackward0", "self", L, n),
            **_node("MulBackward0", "other", L, n),
            # Grouped-query attention is left to torch's kernel, which keeps the same dtypes.
            **{
                ("ScaledDotProductFlashAttentionForCpuBackward0", f, L): n
                for f in ("query", "key", "value", "output")
            },
            **_node("ScaledDotProductFlashAttentionForCpuBackward0", "logsumexp", "fp32", n),
            **_node("EmbeddingBackward0", "indices", "int64", 1),
            **_loss(),
        }
    if isinstance(preset, CNNPreset):
        stages, pooled = len(preset.channels), len(preset.channels) - 1
        return {
            **_node("ConvolutionBackward0", "input", L, stages),
            **_node("ConvolutionBackward0", "weight", L, stages),
            **_node("NativeBatchNormBackward0", "input", L, stages),
            **{
                ("NativeBatchNormBackward0", f, "fp32"): stages
                for f in ("weight", "running_mean", "running_var", "result1", "result2")
            },
            **_node("ReluBackward0", "result", L, stages),
            **_node("MaxPool2DWithIndicesBackward0", "self", L, pooled),
            **_node("MaxPool2DWithIndicesBackward0", "result1", "int64", pooled),  # indices
            **_node("AddmmBackward0", "mat1", L, 1),  # head
            **_node("AddmmBackward0", "mat2", L, 1),
            **_loss(),
        }
    assert isinstance(preset, MLPPreset)
    layers = len(preset.hidden) + 1
    return {
        **_node("AddmmBackward0", "mat1", L, layers),
        # The first layer's input needs no gradient, so its weight is not kept.
        **_node("AddmmBackward0", "mat2", L, layers - 1),
        **_node("ReluBackward0", "result", L, len(preset.hidden)),
        **_loss(),
    }


@pytest.mark.parametrize("low", LOW_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_saves_for_backward_what_cuda_saves(name: str, low: torch.dtype) -> None:
    """Every tensor autograd keeps in the emulated GPU's forward (the step's own loss, attention
    and autocast), by node and field, against the derivation."""
    training = {"precision": "bf16" if low == torch.bfloat16 else "fp16", "seq_len": SEQ}
    if not isinstance(PRESETS[name], DecoderPreset):
        del training["seq_len"]
    spec = Spec.model_validate({"model": {"preset": name}, "training": training})
    torch.manual_seed(0)
    workload = build_workload(spec)
    batch = workload.make_batch(2, torch.device("cpu"))
    with cuda_autocast_policy(), gpu_attention(), torch.autocast("cpu", dtype=low):
        loss = workload.loss_sum(workload.model, batch)
    expected = {
        (node, f, _resolve(d, low)): n for (node, f, d), n in _expected_saved(name).items()
    }
    assert saved_by_node(loss.grad_fn) == Counter(expected)


# ---------------------------------------------------------------------------------------------
# Checkpoint recomputation runs under the same policy; the training step keeps it through
# backward.


class _Block(torch.nn.Module):
    """ops whose dtype the two policies decide differently, recording what each run makes."""

    def __init__(self, runs: list[list[torch.dtype]]) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.runs = runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        normed = self.norm(h)
        probs = F.softmax(h, -1)
        powered = torch.pow(h, 2.0)
        self.runs.append([t.dtype for t in (h, normed, probs, powered)])
        out: torch.Tensor = normed + probs + powered
        return out


def _checkpointed_loss(block: _Block, low: torch.dtype) -> torch.Tensor:
    with torch.autocast("cpu", dtype=low):
        out = checkpoint(block, torch.randn(4, 8), use_reentrant=False)
        return out.sum()


@pytest.mark.parametrize("low", LOW_DTYPES, ids=["bf16", "fp16"])
def test_checkpoint_recomputation_casts_as_the_forward_did(low: torch.dtype) -> None:
    runs: list[list[torch.dtype]] = []
    block = _Block(runs)
    # Without early stop, recomputation runs the whole block, recording included.
    with cuda_autocast_policy(), set_checkpoint_early_stop(False):
        loss = _checkpointed_loss(block, low)
        # Recomputation happens here, outside the autocast region, which checkpoint restores.
        torch.autograd.backward(loss)
    assert len(runs) == 2  # the forward, then the recomputation
    assert runs[0] == runs[1] == [low, torch.float32, torch.float32, torch.float32]
    assert block.linear.weight.grad is not None


@pytest.mark.parametrize("low", LOW_DTYPES, ids=["bf16", "fp16"])
def test_a_recomputation_under_other_lists_is_caught_by_checkpoint(low: torch.dtype) -> None:
    """Checkpoint compares the recomputed saved tensors' dtypes with the forward's: a step that
    left the policy before backward would fail, so a checkpointed step that runs proves that the
    recomputation saved the same dtypes."""
    block = _Block([])
    with cuda_autocast_policy():
        loss = _checkpointed_loss(block, low)
    with pytest.raises(CheckpointError, match="metadata"):
        torch.autograd.backward(loss)


def _block_workload(runs: list[list[torch.dtype]], active: list[bool]) -> Workload:
    blocks = torch.nn.ModuleList([_Block(runs), _Block(runs)])
    switch = checkpoint_blocks(blocks)

    def make_batch(micro_batch: int, device: torch.device) -> Batch:
        return {"x": torch.randn(micro_batch, 8, device=device)}

    def loss_sum(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        active.append(is_cuda_policy_active())
        x = batch["x"]
        for block in model:  # type: ignore[attr-defined]
            x = block(x)
        # Divided by the features: fp16's GradScaler starts at 2**16, and summed gradients of
        # pow(h, 2) then overflow often enough to skip all three steps of the test.
        return x.float().sum() / x.shape[-1]

    return Workload(blocks, make_batch, loss_sum, lambda batch: len(batch["x"]), switch)


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16])
def test_the_training_step_casts_as_cuda_on_the_emulated_gpu(precision: Precision) -> None:
    runs: list[list[torch.dtype]] = []
    active: list[bool] = []
    step = TrainingStep(
        _block_workload(runs, active), TrainingSpec(precision=precision), torch.device("cpu")
    )
    step.checkpointing = True
    before = [p.detach().clone() for p in step.model.parameters()]
    for _ in range(3):  # fp16: the GradScaler's path, unscale and step, more than once
        with set_checkpoint_early_stop(False):
            assert torch.isfinite(torch.tensor(step.run(2, accumulation_steps=2)))
    low = torch.bfloat16 if precision is Precision.BF16 else torch.float16
    # 3 steps x 2 micro-batches x 2 blocks, each run once forward and once recomputed.
    assert len(runs) == 24
    assert all(run == [low, torch.float32, torch.float32, torch.float32] for run in runs)
    assert active == [True] * 6 and not is_cuda_policy_active()
    after = list(step.model.parameters())
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    if step.scaler is not None:
        assert 0 < step.scaler.get_scale() < float("inf")


def test_the_training_step_leaves_fp32_to_torch() -> None:
    runs: list[list[torch.dtype]] = []
    active: list[bool] = []
    step = TrainingStep(_block_workload(runs, active), TrainingSpec(), torch.device("cpu"))
    step.run(2)
    assert active == [False]
    assert all(run == [torch.float32] * 4 for run in runs)


# ---------------------------------------------------------------------------------------------
# Hugging Face modules, where the two policies part ways.

HF_GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64}
HF_LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 2,
    "vocab_size": 64,
}


def _hf_module(config: dict[str, Any], path: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)
    ).float()
    module: torch.nn.Module = model.get_submodule(path)
    # Dropout off: CPU and CUDA run different dropout kernels (CUDA's fused one keeps a bool
    # mask), which is a kernel matter, not autocast's.
    return module.eval()


# (config, module, differs under the CPU lists): GPT-2's MLP computes gelu_new with
# torch.pow(x, 3.0), which CUDA runs in fp32, and so everything after it up to the projection;
# Llama's RMSNorm upcasts to fp32 itself and its MLP uses only listed-alike ops.
HF_MODULES = [
    (HF_GPT2, "transformer.h.0.mlp", True),
    (HF_LLAMA, "model.layers.0.mlp", False),
    (HF_LLAMA, "model.layers.0.input_layernorm", False),
]


@pytest.mark.parametrize("low", LOW_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(("config", "path", "differs"), HF_MODULES, ids=lambda v: str(v))
def test_hugging_face_modules_run_as_torchs_cuda_autocast_runs_them(
    config: dict[str, Any], path: str, differs: bool, low: torch.dtype
) -> None:
    module = _hf_module(config, path)
    state = dict(module.named_parameters())

    def forward(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.func.functional_call(
            module, dict(zip(state, params, strict=True)), x
        )
        return out

    # The residual stream (fp32) into a norm; a 16-bit activation into an MLP.
    x = torch.randn(2, 4, 32, dtype=torch.float32 if path.endswith("layernorm") else low)
    tensors = [x, *state.values()]
    reference = trace_on_fake_cuda(forward, tensors, low)
    assert trace_on_emulated_gpu(forward, tensors, low) == reference
    assert (trace_on_emulated_gpu(forward, tensors, low, policy=False) != reference) == differs
