"""The estimate's fake-tensor mode: torch's `FakeTensorMode`, with a cheaper way into its cache.

A traced step is some thousands of aten ops, and most of an op's cost is torch's fake-tensor
dispatch: a cache hit first builds its key by walking every argument's full metadata in Python
(`FakeTensorMode._cache_key`, about a third of a hit). `TraceMode` keeps a map of its own in
front of torch's cache, keyed by what the key is made of, read straight off the arguments, and
holding torch's own entry and key: a hit builds its output from torch's entry, as torch would
(`FakeTensorMode._output_from_cache_entry`). Only entries torch's cache holds as valid are
kept, and only for arguments whose metadata torch's key is a function of
(docs/design.md#the-layer-replay). Where the entry's output is one new tensor of plain
metadata, the map keeps that metadata and a hit builds the tensor the way torch's path does,
without the checks torch's helpers make for every other case (`TraceMode._build`): torch's
took about 70 us a hit. A constant's `.item()` (AdamW's step counters), which torch's cache
bypasses, is answered with the constant's value, as torch's uncached path answers it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode

try:  # torch's cache internals as of torch 2.13; an older torch's mode takes its own path only
    from torch._subclasses._fake_tensor_utils import _CacheKeyState
    from torch._subclasses.fake_tensor import (
        _BypassDispatchCache,
        _DispatchCacheKey,
        _DispatchCacheValidEntry,
    )

    _PLAIN_KEYS = True
except ImportError:  # pragma: no cover
    _PLAIN_KEYS = False

_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
_VIEW = torch.ops.aten.view.default
_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
_STRIDED = torch.strided
# Arguments that stand in a key as their type and value, as in torch's key.
_PLAIN_TYPES = frozenset(
    {
        int,
        float,
        bool,
        str,
        type(None),
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)
_FAKE_TENSOR_CONFIG: Any = FakeTensorConfig


class _Output(NamedTuple):
    """A cache entry's one output that is a new tensor of plain metadata (no symbolic sizes),
    on a device that is not meta: what torch's `_get_output_tensor_from_cache_entry` builds it
    from. `view_idx` is the argument whose storage a view's output shares."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    requires_grad: bool
    device: torch.device
    is_conj: bool
    is_neg: bool
    view_idx: int | None


def _new_output(entry: _DispatchCacheValidEntry, func: object) -> _Output | None:
    """`entry`'s output as an `_Output`, or None where torch's own path builds it (several
    outputs, an in-place op's argument, a constant, symbolic sizes, another layout, meta)."""
    if entry.is_output_tuple or len(entry.output_infos) != 1:
        return None
    info = entry.output_infos[0]
    metadata = info.metadata
    if info.inplace_idx is not None or metadata is None or metadata.layout is not _STRIDED:
        return None
    shape = tuple(size for size in metadata.shape if isinstance(size, int))
    stride = tuple(size for size in metadata.stride if isinstance(size, int))
    offset = metadata.storage_offset
    if len(shape) != len(metadata.shape) or len(stride) != len(metadata.stride):
        return None  # symbolic sizes
    if not isinstance(offset, int):
        return None
    device = FakeTensor._normalize_fake_device(torch.device(metadata.device))
    if device.type == "meta":
        return None
    is_view = isinstance(func, torch._ops.OpOverload) and func.is_view
    if is_view and info.view_idx is None:
        return None
    return _Output(
        shape=shape,
        stride=stride,
        storage_offset=offset,  # only a view's: torch's empty_strided has 0
        dtype=metadata.dtype,
        requires_grad=metadata.requires_grad,
        device=device,
        is_conj=metadata.is_conj,
        is_neg=metadata.is_neg,
        view_idx=info.view_idx if is_view else None,
    )


_fake_dispatch: Callable[..., Any] = getattr(
    FakeTensorMode.__dict__["__torch_dispatch__"],
    "__wrapped__",
    FakeTensorMode.__dict__["__torch_dispatch__"],
)


class TraceMode(FakeTensorMode):  # type: ignore[no-untyped-call]
    """The estimate's fake-tensor mode, which deep copies of its tensors share.

    A fake tensor carries its mode as an attribute, which `Tensor.__deepcopy__` deep-copies with
    the rest of its `__dict__`: a second mode, with copies of the first one's maps, whose
    `StorageWeakRef` keys are raw weak pointers that each copy frees again. peft's
    `modules_to_save` deep-copies the saved modules, so a storage was freed while in use:
    a segfault in fake-tensor dispatch or in the next dispatcher registration, or a corrupted
    heap at exit. A mode is a context, not a value: a copy of a tensor traces in its mode.
    """

    # What the arguments were (`_plain_key`) -> torch's cache entry and key for them. Shared by
    # every trace mode, as torch's cache is by every fake mode (`FakeTensorMode.cache`): neither
    # key names a mode, and a hit builds its output in the mode that asks (a layout tune's
    # runners, a worker's estimates one after another).
    _entries: ClassVar[
        dict[
            tuple[object, ...],
            tuple[_DispatchCacheValidEntry, _DispatchCacheKey, _Output | None],
        ]
    ] = {}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plain_hits = 0
        self.constant_scalars = 0
        self._fresh_read = False
        self._fresh_attributes: dict[str, object] | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> TraceMode:
        return self

    # Out of torch's guard against torch.compile, as the trackers are
    # (`autotune.engine.emulation.tracker.LiveBytesTracker`): torch wrapped FakeTensorMode's
    # own dispatch in it when the class was made (four eval-frame switches for each of the
    # some 12,000 fake dispatches of a traced step); this class takes the function it wrapped,
    # and so is not wrapped again. No step runs compiled.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(  # one kernel's dispatch, as FakeTensorMode's
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        # torch's fake-tensor cache answers `view` but never `_unsafe_view` (not marked a view,
        # its cached output would get a storage of its own), and an uncached fake dispatch
        # costs some three cached ones (a 70B probe makes 1,433). Below autograd, where this
        # mode runs, the two are one kernel: aten's `view_impl`, the same sizes, strides,
        # storage and errors. The modes above this one see `_unsafe_view` as before.
        if func is _UNSAFE_VIEW:
            func = _VIEW
        if func is _LOCAL_SCALAR_DENSE and len(args) == 1 and not kwargs:
            # A constant's `.item()` (AdamW's step counters, once per parameter in every
            # optimizer step: some 2,400 in a layout's tune of a LoRA model) bypasses torch's
            # cache, and torch's uncached path answers it with the constant's own value: here
            # without that path's checks, which cost some 70 us a call.
            constant = self._constant_of(args[0])
            if constant is not None:
                self.constant_scalars += 1
                with torch._C._DisableTorchDispatch():
                    return func(constant)
        if self._entries and self.cache_enabled:
            key = self._plain_key(func, args, kwargs)
            known = self._entries.get(key) if key is not None else None
            if known is not None:
                self.plain_hits += 1
                entry, torch_key, output = known
                fresh = self._fresh if output is not None else None
                if output is not None and fresh is not None:
                    return self._build(output, args, fresh)
                return self._output_from_cache_entry(
                    _CacheKeyState(self.shape_env), entry, torch_key, func, args
                )
        return _fake_dispatch(self, func, types, args, kwargs)

    def _constant_of(self, arg: object) -> torch.Tensor | None:
        """The real tensor a fake tensor of this mode holds as its value (a constant, of
        concrete sizes), as torch's constant propagation reads it; else None."""
        if type(arg) is not FakeTensor:
            return None
        tensor: Any = arg
        if tensor.fake_mode is not self or tensor._has_symbolic_sizes_strides:
            return None
        constant: torch.Tensor | None = tensor.constant
        return constant

    def _build(
        self, output: _Output, args: Sequence[object], fresh: dict[str, object]
    ) -> FakeTensor:
        """The new fake tensor `output` describes, as torch's `_output_from_cache_entry` builds
        it: an empty meta tensor of its metadata inside a kernel invocation (a view's set on
        its argument's storage) and a `FakeTensor` of this mode around it."""
        storage = None
        if output.view_idx is not None:
            base: Any = args[output.view_idx]
            storage = base.untyped_storage()
        was_in_kernel = self.in_kernel_invocation
        # torch's `in_kernel_invocation_manager`, without its generator.
        with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
            self.in_kernel_invocation = True
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                empty = torch.empty_strided(
                    output.shape,
                    output.stride,
                    dtype=output.dtype,
                    device="meta",
                    requires_grad=output.requires_grad,
                )
                if output.is_conj:
                    torch._C._set_conj(empty, True)
                if output.is_neg:
                    torch._C._set_neg(empty, True)
                if storage is not None:
                    empty.set_(storage, output.storage_offset, output.shape, output.stride)
            finally:
                self.in_kernel_invocation = was_in_kernel
        # `FakeTensor.__new__` for a mode, a meta tensor and a normalised device: the subclass
        # made, its data pointer guarded, its attributes set (`fresh`, from one torch made).
        tensor: Any = torch.Tensor._make_subclass(
            FakeTensor,
            empty,
            output.requires_grad,
            dispatch_device=True,
            device_for_backend_keys=output.device,
        )
        if self._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(tensor)
        else:
            torch._C._set_throw_on_mutable_data_ptr(tensor)
        tensor.__dict__.update(fresh)
        tensor._fake_device = output.device  # normalised when the entry was filed
        built: FakeTensor = tensor
        return built

    @property
    def _fresh(self) -> dict[str, object] | None:
        """The attributes `FakeTensor.__new__` gives a new tensor of this mode, read off one it
        made; None (torch's own path for every hit) unless they are the mode, its device and
        nothing else, as in torch 2.13."""
        if not self._fresh_read:
            self._fresh_read = True
            if not _FAKE_TENSOR_CONFIG.debug:
                with torch._C._DisableTorchDispatch():
                    empty = torch.empty(0, device="meta")
                made = FakeTensor(self, empty, torch.device("cpu"))
                attributes = dict(vars(made))
                plain = {name for name, value in attributes.items() if value is not None}
                if plain == {"_fake_device", "fake_mode"} and made.fake_mode is self:
                    self._fresh_attributes = attributes
        return self._fresh_attributes

    def _cached_dispatch_impl(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object],
        kwargs: Mapping[str, object],
    ) -> object:
        """torch's cached dispatch, which files the entry it made or found under the plain key
        too, when torch's cache holds it as valid."""
        if not _PLAIN_KEYS or self.shape_env is not None:
            return super()._cached_dispatch_impl(func, types, args, kwargs)
        key = self._plain_key(func, args, kwargs)
        torch_key = None
        if key is not None:
            state = _CacheKeyState(self.shape_env)
            try:
                torch_key = self._cache_key(state, func, args, kwargs)
            except _BypassDispatchCache:
                pass
            if state.known_symbols:
                torch_key = None
        out = super()._cached_dispatch_impl(func, types, args, kwargs)
        if key is not None and torch_key is not None:
            entry = FakeTensorMode.cache.get(torch_key)
            if isinstance(entry, _DispatchCacheValidEntry):
                self._entries[key] = (entry, torch_key, _new_output(entry, func))
        return out

    def _plain_key(
        self, func: Any, args: Sequence[object], kwargs: Mapping[str, object] | None
    ) -> tuple[object, ...] | None:
        """Everything torch's cache key is made of, or None where torch's key takes more than
        plain values and fake tensors of this mode with strided, concrete metadata (torch's own
        path then decides). torch's key holds a tensor's dtype, shape, strides, device, layout,
        memory format (a function of the shape and strides), storage offset, storage size,
        requires_grad and conjugate, negative, inference and quantized bits (the last a
        function of the dtype), and the default dtype and device and the inference mode; this
        key holds the same."""
        parts: list[object] = [
            func,
            torch.get_default_dtype(),
            torch._C._get_default_device(),
            torch.is_inference_mode_enabled(),
        ]
        if not self._flatten(parts, args):
            return None
        if kwargs:
            parts.append(dict)  # where the keywords start (no argument is the type itself)
            for name, value in kwargs.items():
                parts.append(name)
                if not self._flatten(parts, (value,)):
                    return None
        return tuple(parts)

    def _flatten(self, parts: list[object], args: Sequence[object]) -> bool:
        append = parts.append
        for arg in args:
            kind = type(arg)
            if kind is FakeTensor:
                tensor: Any = arg
                if (
                    tensor.fake_mode is not self
                    or tensor.constant is not None
                    or tensor.layout is not _STRIDED
                    or tensor._has_symbolic_sizes_strides
                ):
                    return False
                append(
                    (
                        tensor.dtype,
                        tensor.shape,
                        tensor.stride(),
                        tensor._fake_device,  # `fake_device` is a property reading it
                        tensor.storage_offset(),
                        tensor.untyped_storage().nbytes(),
                        tensor.requires_grad,
                        tensor.is_conj(),
                        tensor.is_neg(),
                        tensor.is_inference(),
                    )  # is_quantized is its dtype's
                )
            elif kind in _PLAIN_TYPES:
                append(kind)
                append(arg)
            elif kind is list or kind is tuple or kind is torch.Size:
                items: Any = arg
                append(kind)
                append(len(items))
                if not self._flatten(parts, items):
                    return False
            else:
                return False
        return True
