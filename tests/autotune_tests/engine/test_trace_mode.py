"""The estimate's fake-tensor mode answers from torch's cache entry what torch's key would find."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from autotune.engine.trace_mode import TraceMode


class _Checked(TraceMode):
    """Computes torch's key for every op the plain key answers, and keeps both."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.checked = 0
        self.built = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        view = torch.ops.aten.view.default
        op = view if func is torch.ops.aten._unsafe_view.default else func
        key = self._plain_key(op, args, kwargs)
        known = self._entries.get(key) if key is not None else None
        torch_built = None
        if known is not None:
            state = _CacheKeyState(self.shape_env)
            torch_key = self._cache_key(state, op, args, kwargs or {})
            assert torch_key == known[1], func
            self.checked += 1
            if known[2] is not None:
                # What torch's own path builds from the entry, to compare with this mode's.
                torch_built = FakeTensorMode._output_from_cache_entry(
                    self, state, known[0], torch_key, op, args
                )
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if torch_built is not None:
            assert _built(out, args) == _built(torch_built, args), func
            self.built += 1
        return out


def _built(tensor: Any, args: Sequence[object]) -> object:
    """Everything of a fake tensor its op's output is made of: its class, attributes (mode,
    device, memos), metadata and flags, and which argument's storage it shares."""
    assert type(tensor) is FakeTensor
    shares = [
        i
        for i, arg in enumerate(args)
        if isinstance(arg, torch.Tensor)
        and arg.untyped_storage()._cdata == tensor.untyped_storage()._cdata
    ]
    return (
        dict(vars(tensor)),
        tensor.dtype,
        tensor.shape,
        tensor.stride(),
        tensor.storage_offset(),
        tensor.untyped_storage().nbytes(),
        tensor.requires_grad,
        tensor.is_conj(),
        tensor.is_neg(),
        tensor.is_inference(),
        tensor.device,
        tensor.layout,
        torch._C._dispatch_keys(tensor),
        tensor._version,
        tensor.is_leaf,
        tensor.grad_fn,
        shares,
    )


def _metadata(out: object) -> object:
    if isinstance(out, torch.Tensor):
        return (
            out.dtype,
            tuple(out.shape),
            out.stride(),
            out.storage_offset(),
            out.untyped_storage().nbytes(),
            out.requires_grad,
            out.device,
        )
    if isinstance(out, (list, tuple)):
        return [_metadata(item) for item in out]
    return out


def _steps(mode: FakeTensorMode) -> list[object]:
    """Two training steps of a small attention block with AdamW, under `mode`; what each
    parameter, gradient and optimizer state looks like after each."""
    seen: list[object] = []
    with mode:
        torch.manual_seed(0)
        block = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        head = nn.Linear(32, 8)
        params = [*block.parameters(), *head.parameters()]
        optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
        for batch in (3, 3):
            x = torch.randn(batch, 6, 32)
            loss = head(block(x)).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seen.append(
                _metadata([*params, *(s for st in optimizer.state.values() for s in st.values())])
            )
            seen.append(_metadata(loss))
    return seen


def test_every_answer_of_the_plain_key_is_what_torch_s_key_finds() -> None:
    checked = _Checked()
    traced = _steps(checked)
    # The same steps under torch's own fake mode, its cache off: the same tensors.
    plain = FakeTensorMode(allow_non_fake_inputs=True)
    plain.cache_enabled = False
    assert traced == _steps(plain)
    # The second step is answered by the plain key, every answer
    # the entry torch's key finds.
    assert checked.plain_hits == checked.checked > 100
    # Most answers are new tensors, built as torch's own path builds them from the entry.
    assert checked.built > checked.checked / 2


def _variants(mode: FakeTensorMode) -> list[object]:
    """Tensors that differ from one another in one keyed field each, and an op on each, twice."""
    seen: list[object] = []
    with mode:
        base = torch.empty(4, 6)
        variants = [
            base,
            base.to(torch.bfloat16),  # dtype
            base.t().contiguous().t(),  # strides
            torch.empty(25)[1:].view(4, 6),  # storage offset
            torch.empty(30)[:24].view(4, 6),  # storage size
            base.clone().requires_grad_(),
            torch.empty(4, 6, dtype=torch.complex64).conj(),
        ]
        for _ in range(2):  # the second round is answered by the plain key
            for tensor in variants:
                seen.append(_metadata(tensor.reshape(-1)))
                seen.append(_metadata(tensor[1:].sum(0)))
                seen.append(_metadata(tensor.add_(1) if not tensor.requires_grad else tensor))
    return seen


def test_tensors_that_differ_in_any_keyed_field_are_told_apart() -> None:
    mode = _Checked()
    traced = _variants(mode)
    assert mode.plain_hits >= 14
    assert mode.built >= 14  # the conjugate's views among them
    plain = FakeTensorMode()
    plain.cache_enabled = False
    assert traced == _variants(plain)
    # The views share their bases' storage: the offsets and sizes tell them apart.
    assert [meta[3:5] for meta in traced[9:15:3]] == [(1, 100), (0, 120)]


def test_a_second_mode_is_answered_from_the_first_one_s_entries_in_its_own_mode() -> None:
    first, second = TraceMode(), TraceMode()
    with first:
        torch.empty(3, 7, dtype=torch.float16).t().contiguous()
    with second:
        out = torch.empty(3, 7, dtype=torch.float16).t().contiguous()
    assert second.plain_hits >= 2  # the transpose and the copy, never dispatched in `second`
    assert out.fake_mode is second and out.stride() == (3, 1) and out.shape == (7, 3)


def test_the_trace_mode_answers_unsafe_view_from_torch_s_cache_as_a_view() -> None:
    unsafe_view = torch.ops.aten._unsafe_view.default
    outputs = []
    for mode in (FakeTensorMode(), TraceMode()):
        with mode:
            base = torch.empty(4, 6, 8)[1:]
            bypasses = FakeTensorMode.cache_bypasses["unsafe view"]
            for size in ([18, 8], [3, 48], [3, 6, 8], [18, 8]):
                out = unsafe_view(base, size)
                assert out.untyped_storage()._cdata == base.untyped_storage()._cdata
                outputs.append((out.shape, out.stride(), out.storage_offset()))
            # A plain fake mode bypasses its cache for every one; the trace mode for none.
            answered = FakeTensorMode.cache_bypasses["unsafe view"] - bypasses
            assert answered == (0 if isinstance(mode, TraceMode) else 4)
            with pytest.raises(ValueError, match="Cannot view a tensor"):
                unsafe_view(torch.empty(4, 6).t(), [24])
        assert not out._is_view() and out.dtype == torch.float32
    assert outputs[:4] == outputs[4:]


def test_a_constant_s_item_is_its_value_without_torch_s_uncached_path() -> None:
    # AdamW's step counters are constants (`torch.tensor` under the mode): each `.item()`
    # bypasses torch's cache. The trace mode answers it with the constant's value, as torch's
    # constant propagation does; what is not a constant still raises as in torch.
    answers = []
    for mode in (FakeTensorMode(), TraceMode()):
        with mode:
            counters = [torch.tensor(3.0), torch.tensor(7), torch.tensor(True)]
            stepped = counters[0] + 1  # a constant made by an op on one
            answers.append([c.item() for c in (*counters, stepped)])
            with pytest.raises(torch._subclasses.fake_tensor.DataDependentOutputException):
                torch.empty(()).item()
        if isinstance(mode, TraceMode):
            assert mode.constant_scalars == 4
    assert answers[0] == answers[1] == [3.0, 7, True, 4.0]
    assert [type(a) for a in answers[1]] == [float, int, bool, float]
