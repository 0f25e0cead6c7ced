"""Workloads: a model plus how to make a batch and its summed loss, built from any model source.

A `Workload` is everything `autotune.engine.training.step.TrainingStep` needs to run real training
steps. It is built from a `Spec` by `build_workload`, from one of four sources:

* ``preset``: a built-in model from `autotune.engine.training.zoo`.
* ``hf_config``: a transformers config dict, built with random weights (nothing downloaded).
* ``hf_id``: a Hugging Face hub id (`autotune.core.hubid`); only its config.json is fetched, never
  its weights, and never read from a local directory.
* ``factory``: your own code, given as ``"package.module:function"``.

The factory contract
--------------------
The module is imported only when the workload is built (validating a spec never imports user
code), so it must be importable then: installed, or on ``PYTHONPATH``. The function is called
as ``function(training)`` with the spec's `autotune.core.schemas.TrainingSpec` and must return an
`autotune.engine.training.workload.Workload`:

* ``model``: the `nn.Module`, on any device (autotune moves it, in fp32, to the device);
* ``make_batch(micro_batch, device)``: a new batch of ``micro_batch`` samples whose tensors are
  created on ``device`` (memory is only counted for tensors created inside a trial);
* ``loss_sum(model, batch)``: the SUM of the per-item losses (per label token for language
  models, per sample otherwise), not the mean: autotune divides by the item count of the whole
  accumulated step so that gradient accumulation is exact;
* ``num_items(batch)``: how many items ``loss_sum`` sums over (label tokens != -100, samples),
  an int or a 0-dim tensor (a tensor keeps the step free of reads of values: see
  `count_label_tokens`);
* ``set_checkpointing(enabled)``: turns gradient checkpointing on or off; None if unsupported;
* ``partial_checkpointing``: checkpointing of only the first k blocks
  (`autotune.engine.training.checkpointing.PartialCheckpointing`); None if unsupported. A
  ``set_checkpointing`` made by `checkpoint_blocks` offers it by itself;
* ``tokens_per_sample``: tokens in one sample, to report tokens/s; None for non-token models.

An import or attribute error, or a return value that is not a `Workload`, raises
`ModelBuildError` naming the factory.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import threading
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autotune.core.errors import AutotuneError, ModelBuildError, SpecError
from autotune.core.factoryaccess import check_factory_allowed
from autotune.core.hubid import hub_id_problem
from autotune.core.plugins import import_extra
from autotune.core.presets import PRESETS, DecoderPreset
from autotune.core.schemas import Spec, TrainingSpec
from autotune.engine.training.checkpointing import BlockCheckpointing, PartialCheckpointing
from autotune.engine.training.zoo import build_model

logger = logging.getLogger(__name__)

Batch = Any
IGNORE_INDEX = -100  # the label that marks padding, as in PyTorch's cross_entropy and transformers
HUB_TIMEOUT_S = 10.0  # how long a hub reachability check may take before we give up


@dataclass
class Workload:
    """A model and the callables that feed it; see the module docstring for the contract."""

    model: nn.Module
    make_batch: Callable[[int, torch.device], Batch]
    loss_sum: Callable[[nn.Module, Batch], torch.Tensor]
    num_items: Callable[[Batch], int | torch.Tensor]
    set_checkpointing: Callable[[bool], None] | None = None
    tokens_per_sample: int | None = None
    partial_checkpointing: PartialCheckpointing | None = None

    def __post_init__(self) -> None:
        if self.partial_checkpointing is None and isinstance(
            self.set_checkpointing, BlockCheckpointing
        ):
            self.partial_checkpointing = self.set_checkpointing


# ---------------------------------------------------------------------------------------------
# Losses shared by every token model, so that presets and Hugging Face models count the same way.


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy, computed the way transformers' ForCausalLMLoss does:
    logits upcast to fp32, labels shifted left (so the (b, s, V) logits are not copied)."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    return F.cross_entropy(
        logits.float().view(-1, logits.shape[-1]),
        shifted.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def fp32_on(model: nn.Module, device: torch.device) -> nn.Module:
    """`model` with fp32 floating tensors on `device`, converted only when it is not already:
    a model made on fake tensors (the estimate) cannot have its tensors swapped."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    if any(
        t.device != device or (t.is_floating_point() and t.dtype != torch.float32) for t in tensors
    ):
        return model.to(device=device, dtype=torch.float32)
    return model


def cast_weights(
    model: nn.Module, dtype: torch.dtype, *, keep: Set[int] = frozenset()
) -> nn.Module:
    """`model` with its floating parameters (but those whose id is in `keep`) and buffers in
    `dtype`, as `model.to(dtype)` would leave it; new tensors are assigned rather than swapped
    in place, which a model made on fake tensors (the estimate) does not allow. Tied parameters
    stay tied."""
    converted: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) in keep:
                continue
            if id(param) not in converted:
                converted[id(param)] = nn.Parameter(
                    param.detach().to(dtype), requires_grad=param.requires_grad
                )
            module._parameters[name] = converted[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                module._buffers[name] = buffer.to(dtype)
    return model


def count_label_tokens(batch: Batch) -> torch.Tensor:
    """Label tokens that `causal_lm_loss_sum` sums over: all but the first, minus padding.

    A tensor, not an int: reading its value would stop a step that runs on fake tensors (the
    estimate), and on a GPU it would wait for the device."""
    count: torch.Tensor = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    return count


def _token_batch_maker(vocab_size: int, seq_len: int) -> Callable[[int, torch.device], Batch]:
    def make_batch(micro_batch: int, device: torch.device) -> Batch:
        ids = torch.randint(0, vocab_size, (micro_batch, seq_len), device=device)
        return {"input_ids": ids, "labels": ids}

    return make_batch


def _token_workload(
    model: nn.Module,
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    vocab_size: int,
    seq_len: int,
    set_checkpointing: Callable[[bool], None] | None,
    partial_checkpointing: PartialCheckpointing | None = None,
) -> Workload:
    def loss_sum(module: nn.Module, batch: Batch) -> torch.Tensor:
        return causal_lm_loss_sum(logits(module, batch["input_ids"]), batch["labels"])

    return Workload(
        model=model,
        make_batch=_token_batch_maker(vocab_size, seq_len),
        loss_sum=loss_sum,
        num_items=count_label_tokens,
        set_checkpointing=set_checkpointing,
        tokens_per_sample=seq_len,
        partial_checkpointing=partial_checkpointing,
    )


# ---------------------------------------------------------------------------------------------
# Source 1: presets.


def build_preset(
    name: str, *, seq_len: int | None = None, input_shape: tuple[int, ...] | None = None
) -> Workload:
    """A workload for a built-in model. Token models default to the preset's max_seq_len."""
    preset = PRESETS[name]
    if isinstance(preset, DecoderPreset):
        if input_shape is not None:
            raise SpecError("training.input_shape: this is a token model; give seq_len instead")
        seq_len = seq_len or preset.max_seq_len
        if seq_len > preset.max_seq_len:
            raise SpecError(
                f"training.seq_len: {seq_len} exceeds the max_seq_len {preset.max_seq_len} "
                f"of preset {name!r}"
            )
        model = build_model(preset)
        return _token_workload(
            model, _call_on_ids, preset.vocab_size, seq_len, model.checkpointing_switch
        )
    if seq_len is not None:
        raise SpecError("training.seq_len: this model takes fixed-shape inputs")
    shape = input_shape or preset.input_shape
    if preset.kind == "cnn" and len(shape) != 3:
        raise SpecError(f"training.input_shape: the cnn preset needs [C, H, W], got {list(shape)}")
    model = build_model(preset, shape)
    num_classes = preset.num_classes

    def make_batch(micro_batch: int, device: torch.device) -> Batch:
        return {
            "inputs": torch.randn(micro_batch, *shape, device=device),
            "labels": torch.randint(0, num_classes, (micro_batch,), device=device),
        }

    def loss_sum(module: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(module(batch["inputs"]).float(), batch["labels"], reduction="sum")

    def num_items(batch: Batch) -> int:
        return int(batch["labels"].shape[0])

    return Workload(model, make_batch, loss_sum, num_items, model.checkpointing_switch)


def _call_on_ids(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    logits: torch.Tensor = model(input_ids)
    return logits


# ---------------------------------------------------------------------------------------------
# Sources 2 and 3: Hugging Face configs, given inline or fetched from the hub.


def _import_transformers() -> Any:
    return import_extra("transformers", needed_for="Hugging Face models", extra="hf")


def _config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for a config it refuses; transformers 5's configs are strict
    dataclasses, whose field errors do not derive from ValueError."""
    from huggingface_hub.errors import StrictDataclassError

    return (ValueError, TypeError, KeyError, StrictDataclassError)


def build_hf_config(config: dict[str, Any], training: TrainingSpec) -> Workload:
    """A workload for a transformers config dict, with random weights."""
    transformers = _import_transformers()
    try:
        hf_config = transformers.AutoConfig.for_model(**config)
    except _config_errors() as exc:
        raise ModelBuildError(f"hf_config: transformers rejected the config: {exc}") from exc
    return _build_hf_model(hf_config, training, label=f"hf_config ({config['model_type']})")


def build_hf_id(hf_id: str, training: TrainingSpec) -> Workload:
    """A workload for a hub model's config, with random weights.

    Only the hub's `config.json` is fetched, through `huggingface_hub` (a cached copy is used
    without the network), so `hf_id` is only ever a hub id, never a local directory. The file
    is parsed here and the config built from its `model_type` with `AutoConfig.for_model`, as
    for `hf_config`: nothing in the file can name code to run (no remote code, ever). An
    unreachable hub fails within about HUB_TIMEOUT_S seconds rather than going through
    huggingface_hub's retries (23 s or more). Errors name the file and what is wrong with it,
    never its text.
    """
    transformers = _import_transformers()
    problem = hub_id_problem(hf_id)
    if problem is not None:  # validated specs never get here; a direct call might
        raise SpecError(f"hf_id: not a Hugging Face hub id: {problem}")
    path = _fetch_hub_config(hf_id)
    label = f"hf_id {hf_id!r}"
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelBuildError(
            f"{label}: its config.json ({path}) is not a readable JSON file ({type(exc).__name__})"
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelBuildError(f'{label}: its config.json ({path}) has no "model_type" string')
    if config.pop("auto_map", None) is not None:
        logger.warning("%s: ignoring auto_map (autotune never runs a model's remote code)", label)
    try:
        hf_config = transformers.AutoConfig.for_model(**config)
    except _config_errors() as exc:
        raise ModelBuildError(
            f"{label}: transformers rejected its config.json ({path}): {type(exc).__name__}"
        ) from None
    return _build_hf_model(hf_config, training, label=label, quote_errors=False)


def _fetch_hub_config(hf_id: str) -> str:
    """The local path of the hub model's config.json: from the cache, else downloaded."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    try:
        try:
            path: str = huggingface_hub.hf_hub_download(
                hf_id, "config.json", local_files_only=True
            )
        except EntryNotFoundError:  # not in the local cache
            _check_hub_reachable(hf_id)
            path = huggingface_hub.hf_hub_download(hf_id, "config.json")
    except (OSError, ValueError, EntryNotFoundError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _hub_error(hf_id, reason) from exc
    return path


def _hub_error(hf_id: str, reason: str) -> ModelBuildError:
    return ModelBuildError(
        f"hf_id: could not fetch config for '{hf_id}' from the Hugging Face hub ({reason}); "
        "pass hf_config instead"
    )


def _check_hub_reachable(hf_id: str) -> None:
    """One HEAD request for config.json, in a daemon thread so that even a hanging DNS lookup
    cannot block us longer than HUB_TIMEOUT_S."""
    import huggingface_hub

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise _hub_error(hf_id, "HF_HUB_OFFLINE is set and the config is not in the local cache")
    failure: list[str] = []

    def head() -> None:
        try:
            url = huggingface_hub.hf_hub_url(hf_id, "config.json")
            huggingface_hub.get_session().head(url, timeout=HUB_TIMEOUT_S)
        except Exception as exc:  # any transport failure means "unreachable"
            failure.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=head, name="autotune-hub-check", daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT_S + 1.0)
    if thread.is_alive():
        raise _hub_error(hf_id, f"no answer within {HUB_TIMEOUT_S:.0f} s")
    if failure:
        raise _hub_error(hf_id, failure[0])


def _build_hf_model(
    hf_config: Any, training: TrainingSpec, label: str, *, quote_errors: bool = True
) -> Workload:
    """`quote_errors=False` for a config read from a file: its values stay out of messages."""
    transformers = _import_transformers()
    if getattr(hf_config, "auto_map", None):
        raise ModelBuildError(f"{label}: auto_map names remote code, which autotune never runs")
    hf_config.use_cache = False
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else None
    vocab_size = getattr(text_config or hf_config, "vocab_size", None)
    max_positions = getattr(text_config or hf_config, "max_position_embeddings", None)
    seq_len = training.seq_len
    if seq_len is None:
        raise SpecError("training.seq_len: required for Hugging Face models")
    if isinstance(max_positions, int) and seq_len > max_positions:
        raise SpecError(
            f"training.seq_len: {seq_len} exceeds max_position_embeddings {max_positions} "
            f"of {label}"
        )
    if not isinstance(vocab_size, int):
        raise ModelBuildError(f"{label}: the config has no integer vocab_size")
    try:
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="sdpa"
        )
    except _config_errors() + (ImportError,) as exc:
        reason = str(exc) if quote_errors else type(exc).__name__
        raise ModelBuildError(f"{label}: could not build a causal LM: {reason}") from None
    # fp32 master weights whatever the config's dtype says: precision is the spec's business.
    model = fp32_on(model, model.device)
    if not model.supports_gradient_checkpointing:
        return _token_workload(model, _hf_logits, vocab_size, seq_len, None)
    switch = _HfCheckpointing(model)
    partial = switch if switch.num_blocks > 0 else None
    return _token_workload(model, _hf_logits, vocab_size, seq_len, switch, partial)


def _hf_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    # No labels go in: the loss is computed by causal_lm_loss_sum, exactly as for presets, so
    # it is a sum we normalise ourselves (transformers' num_items_in_batch, done outside).
    logits: torch.Tensor = model(input_ids=input_ids, use_cache=False).logits
    return logits


class _HfCheckpointing:
    """A transformers model's checkpointing switch, and, where its layers are
    `GradientCheckpointingLayer`s (each with its own `gradient_checkpointing` flag), checkpointing
    of the first k of them only: enable them all as transformers does, then clear the flag on
    the others."""

    def __init__(self, model: Any) -> None:
        # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_*.
        new_api = hasattr(model, "activation_checkpointing_enable")
        self._prefix = "activation" if new_api else "gradient"
        self._model = model
        self._enabled = False
        self._count: int | None = None
        layer_class = getattr(
            importlib.import_module("transformers.modeling_layers"),
            "GradientCheckpointingLayer",
            None,
        )
        self._layers = (
            [m for m in model.modules() if isinstance(m, layer_class)] if layer_class else []
        )
        # Enabling hooks the input embeddings so that gradients reach the first checkpointed
        # layer through frozen embeddings (adapters); disabling removes the hook only for
        # transformers' own PEFT integration, not for a model peft wraps from outside. Left in
        # place, every later plain step computes the first layer's input gradient too: a plain
        # step would depend on whether a checkpointed one ran before it. Hooks the model had
        # before the switch are its owner's, and stay.
        self._owner_hooks_inputs = bool(getattr(model, "_require_grads_hooks", None))

    @property
    def num_blocks(self) -> int:
        return len(self._layers)

    @property
    def layers(self) -> list[nn.Module]:
        """The model's decoder layers, in order."""
        return list(self._layers)

    def __call__(self, enabled: bool) -> None:
        # Turned on while on, the switch stays as it is: transformers' enable hooks the input
        # embeddings again each time, and keeps only the newest hooks to remove, so the one
        # before stayed for good (a step turns checkpointing on for each trial, and a tune's
        # checkpointed trials and speed passes run one after another): every later plain step
        # computed the first layer's input gradient, and its time depended on its history.
        if enabled and not self._enabled:
            getattr(self._model, f"{self._prefix}_checkpointing_enable")({"use_reentrant": False})
        elif not enabled:
            getattr(self._model, f"{self._prefix}_checkpointing_disable")()
            if not self._owner_hooks_inputs:
                self._model.disable_input_require_grads()
        self._enabled = enabled
        if enabled:
            self._apply_limit()

    def limit(self, count: int | None) -> None:
        self._count = count
        if self._enabled:
            self._apply_limit()

    def _apply_limit(self) -> None:
        for index, layer in enumerate(self._layers):
            layer.gradient_checkpointing = self._count is None or index < self._count


def hf_checkpointing(model: nn.Module) -> _HfCheckpointing:
    """The checkpointing switch (all layers, or the first k) of a transformers model that
    supports it, for a workload built around a model someone already has."""
    return _HfCheckpointing(model)


# ---------------------------------------------------------------------------------------------
# Source 4: user factories.


def build_factory(
    path: str, training: TrainingSpec, *, allowed_prefixes: Sequence[str] | None = None
) -> Workload:
    """Import ``package.module:function`` and call it with `training`.

    Args:
        path: the spec's ``factory``.
        training: passed to the function.
        allowed_prefixes: None imports any module (your own spec, on your own machine). A probe
            worker passes its ``--allow-factory`` prefixes (`autotune.core.factoryaccess`).

    Raises:
        FactoryRefused: the module is outside `allowed_prefixes`; nothing was imported.
        ModelBuildError: the module or function cannot be imported, the function raised, or it
            returned something other than a `Workload`.
    """
    if allowed_prefixes is not None:
        check_factory_allowed(path, allowed_prefixes)
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            # The factory's own module (or its package) is missing, not one it imports.
            raise ModelBuildError(
                f"factory {path!r}: No module named {exc.name!r} on this process's path "
                f"(sys.path). The factory's module must be importable where the model is built "
                f"(by `autotune probe`/`tune`, or by the worker's trial processes): install its "
                f"package, or add the directory that holds it to PYTHONPATH, e.g. "
                f"PYTHONPATH=/dir/of/the/spec; a module next to the spec file is not found "
                f"by itself"
            ) from exc
        raise ModelBuildError(
            f"factory {path!r}: importing {module_name!r} failed: {exc}"
        ) from exc
    except Exception as exc:  # user code at import time: any error is the factory's
        raise ModelBuildError(
            f"factory {path!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    try:
        function = getattr(module, function_name)
    except AttributeError as exc:
        raise ModelBuildError(f"factory {path!r}: AttributeError: {exc}") from exc
    try:
        workload = function(training)
    except AutotuneError:
        raise
    except Exception as exc:
        raise ModelBuildError(f"factory {path!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload) or not isinstance(workload.model, nn.Module):
        raise ModelBuildError(
            f"factory {path!r} must return an autotune.engine.training.workload.Workload with "
            f"an nn.Module model, got {type(workload).__name__}"
        )
    if workload.tokens_per_sample is not None and workload.tokens_per_sample < 1:
        raise ModelBuildError(f"factory {path!r}: tokens_per_sample must be >= 1")
    _check_factory_shapes(path, workload, training)
    return workload


def _check_factory_shapes(path: str, workload: Workload, training: TrainingSpec) -> None:
    """The spec's shape must be the one the factory's batches have: a seq_len the factory
    ignores would be measured (and reported) as if it had been used."""
    tokens = workload.tokens_per_sample
    if tokens is not None and training.input_shape is not None:
        raise SpecError(
            f"training.input_shape: factory {path!r} builds a token model "
            f"(tokens_per_sample={tokens}); give training.seq_len instead"
        )
    if training.seq_len is not None and tokens is None:
        raise SpecError(
            f"training.seq_len: factory {path!r} returned tokens_per_sample=None; a token "
            "model's Workload sets tokens_per_sample=training.seq_len (for non-token models, "
            "give training.input_shape instead)"
        )
    if training.seq_len is not None and tokens != training.seq_len:
        raise SpecError(
            f"training.seq_len: {training.seq_len}, but factory {path!r} makes samples of "
            f"{tokens} tokens (tokens_per_sample); make its batches from training.seq_len"
        )


def build_workload(
    spec: Spec, *, allowed_factory_prefixes: Sequence[str] | None = None
) -> Workload:
    """The workload for a validated spec, from whichever model source it names.
    `allowed_factory_prefixes`: see `build_factory` (None: any factory)."""
    source, training = spec.model, spec.training
    if source.preset is not None:
        return build_preset(
            source.preset, seq_len=training.seq_len, input_shape=training.input_shape
        )
    if source.hf_config is not None:
        return build_hf_config(source.hf_config, training)
    if source.hf_id is not None:
        return build_hf_id(source.hf_id, training)
    assert source.factory is not None
    return build_factory(source.factory, training, allowed_prefixes=allowed_factory_prefixes)
