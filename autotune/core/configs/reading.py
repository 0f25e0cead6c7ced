"""Which kind of file was given, told by its content, and the spec it stands for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.core.configs import axolotl, deepspeed, hf_args
from autotune.core.configs.conversion import ConfigFormat, Converted
from autotune.core.configs.ranks import RankOptions, refuse_for_a_spec
from autotune.core.errors import SpecError
from autotune.core.specfile import parse_spec, read_spec_data

_SPEC_SECTIONS = frozenset({"model", "training"})


def detect_format(data: Any) -> ConfigFormat:
    """The format of parsed file content; a spec when it is none of the others (its own
    validation then says what is wrong)."""
    if not isinstance(data, dict) or "model" in data or set(data) <= _SPEC_SECTIONS:
        return ConfigFormat.SPEC
    if axolotl.is_axolotl(data):
        return ConfigFormat.AXOLOTL
    if hf_args.is_hf_arguments(data):
        return ConfigFormat.HF_ARGS
    if deepspeed.is_deepspeed(data):
        return ConfigFormat.DEEPSPEED
    return ConfigFormat.SPEC


def load_training_file(
    path: str | Path,
    *,
    model: str | None = None,
    seq_len: int | None = None,
    ranks: RankOptions | None = None,
) -> Converted:
    """A spec file, or an Axolotl, TrainingArguments or DeepSpeed file read as a spec.
    `model` (a hub id or a local directory with config.json) replaces Axolotl's `base_model`
    and is needed for the other two, as `seq_len` (tokens per sample) is; `ranks` says the
    ranks and layout where the file cannot (`autotune.core.configs.ranks`).

    Raises:
        SpecError: unreadable, or a setting that cannot be modelled; starts with the path and
            names the field.
    """
    path = Path(path)
    options = ranks or RankOptions()
    data = read_spec_data(path)
    kind = detect_format(data)
    try:
        if kind is ConfigFormat.SPEC:
            for flag, value in (("--model", model), ("--seq-len", seq_len)):
                if value is not None:
                    raise SpecError(f"{flag}: the spec says it (model / training.seq_len)")
            refuse_for_a_spec(options)
            return Converted(spec=parse_spec(data), format=kind, path=path, data=data)
        if kind is ConfigFormat.AXOLOTL:
            if seq_len is not None:
                raise SpecError("--seq-len: an Axolotl config says it (sequence_len)")
            return axolotl.convert(data, path, model=model, options=options)
        if kind is ConfigFormat.HF_ARGS:
            return hf_args.convert(data, path, model=model, seq_len=seq_len, options=options)
        return deepspeed.convert(data, path, model=model, seq_len=seq_len, options=options)
    except SpecError as error:
        raise SpecError(f"{path}: {error}") from None
