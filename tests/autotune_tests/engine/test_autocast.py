"""CUDA's autocast policy on the emulated GPU (`autotune.engine.autocast`).

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

from autotune.engine.attention import gpu_attention
from autotune.engine.autocast import (
    CUDA_POLICY,
    CastPolicy,
    cpu_listed_ops,
    cuda_autocast_policy,
    is_cuda_policy_active,
)

from .cuda_autocast_oracle import (
    ops_registered_for,
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
