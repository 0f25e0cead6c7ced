"""What reading a training config gives: the spec, the format it came in and what of the file
the spec does not carry."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from autotune.core.errors import SpecError
from autotune.core.schemas import ModelSpec, Sharding, Spec, TrainingSpec

# The spec's default search cap (`TrainingSpec.max_micro_batch`); a file's own batch lowers it.
SEARCH_CAP = TrainingSpec.model_fields["max_micro_batch"].default


class ConfigFormat(StrEnum):
    SPEC = "autotune spec"
    AXOLOTL = "Axolotl config"
    HF_ARGS = "Hugging Face TrainingArguments"
    DEEPSPEED = "DeepSpeed config"


@dataclass(frozen=True)
class Converted:
    """A file read as a spec. `unmapped`: one line per setting of the file that the spec does
    not model ("key: why"), for people to judge; `data` is the file's parsed content;
    `layout` the sharding its own keys say (the spec's may differ: one rank, `--sharding`)."""

    spec: Spec
    format: ConfigFormat
    path: Path
    data: Any = None
    unmapped: tuple[str, ...] = field(default=())
    layout: Sharding = Sharding.NONE


def refuse(key: str, reason: str) -> SpecError:
    """The one-line refusal of a setting that cannot be modelled, naming it."""
    return SpecError(f"{key}: {reason}")


def positive_int(data: dict[str, Any], key: str, default: int | None = None) -> int:
    """`data[key]` as an integer >= 1 (`default` when absent or null).

    Raises:
        SpecError: absent without a default, or not a positive integer (e.g. "auto").
    """
    value = data.get(key)
    if value is None and default is not None:
        return default
    if type(value) is not int or value < 1:
        shown = "missing" if value is None else repr(value)
        raise refuse(key, f"{shown}: a number of samples (an integer >= 1) is needed")
    return value


def build_spec(model: ModelSpec, **training: Any) -> Spec:
    """The spec of a converted file.

    Raises:
        SpecError: the values make no valid spec; the message names the field.
    """
    from pydantic import ValidationError

    from autotune.core.specfile import describe_validation_error

    try:
        return Spec(model=model, training=TrainingSpec(**training))
    except ValidationError as error:
        raise SpecError(describe_validation_error(error)) from None


def named_elsewhere(model: str | None, seq_len: int | None, *, kind: str) -> tuple[str, int]:
    """`--model` and `--seq-len`, which a file of `kind` does not carry.

    Raises:
        SpecError: either is missing, naming the option.
    """
    if model is None:
        raise refuse(
            "--model", f"a {kind} names no model: give a hub id or a local model directory"
        )
    if seq_len is None:
        raise refuse(
            "--seq-len",
            f"a {kind} has no sequence length: give the tokens per sample (the longest)",
        )
    return model, seq_len
