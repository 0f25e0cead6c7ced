"""Reading a spec file (YAML or JSON) into a validated `Spec`, with one-line errors.

Validation never imports user code: a `factory` is only a string here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from autotune.core.errors import SpecError
from autotune.core.schemas import Spec


def describe_validation_error(error: ValidationError) -> str:
    """The first problem of a pydantic error as one line that names the field."""
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    # Validators on a section report the field themselves ("preset: unknown preset ...").
    if location and not message.startswith(location.rsplit(".", 1)[-1] + ":"):
        message = f"{location}: {message}"
    more = len(error.errors()) - 1
    return message + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


def parse_spec(data: Any) -> Spec:
    """Validate already-parsed spec data.

    Raises:
        SpecError: the data is not a valid spec; the message names the field.
    """
    if not isinstance(data, dict):
        raise SpecError("spec: expected a mapping with `model` and `training` sections")
    try:
        return Spec.model_validate(data)
    except ValidationError as error:
        raise SpecError(describe_validation_error(error)) from None


def _syntax_error(error: json.JSONDecodeError | yaml.YAMLError) -> str:
    """Where the file stops parsing (line and column, from 1) and why, on one line."""
    if isinstance(error, json.JSONDecodeError):
        return f"line {error.lineno}, column {error.colno}: {error.msg}"
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def load_spec(path: str | Path) -> Spec:
    """Read and validate a YAML or JSON spec file.

    Raises:
        SpecError: the file is missing, unparsable or invalid.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SpecError(f"{path}: cannot read spec file ({error.strerror})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        kind = path.suffix.lstrip(".") or "YAML"
        raise SpecError(f"{path}: not valid {kind}: {_syntax_error(error)}") from None
    try:
        return parse_spec(data)
    except SpecError as error:
        raise SpecError(f"{path}: {error}") from None
