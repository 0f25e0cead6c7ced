"""Reading a spec file (YAML or JSON) into a validated `Spec`, with one-line errors.

Validation never imports user code: a `factory` is only a string here. Spec text comes from
users (the server's submit form, a file): `parse_spec_text` reads it within limits, so that no
text makes parsing slow or huge: at most `SPEC_TEXT_MAX_BYTES`, nested at most
`SPEC_DEPTH_MAX` levels, and no YAML aliases (an alias repeats a node by reference: six levels
of them turned 425 bytes into a 4.7 MB spec). A spec has no use for any of these.
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


SPEC_TEXT_MAX_BYTES = 64 * 1024
SPEC_DEPTH_MAX = 32

_OPENS = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSES = (yaml.MappingEndEvent, yaml.SequenceEndEvent)
# libyaml's parser when built in (30x faster than the pure-Python one); same results.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _syntax_error(error: json.JSONDecodeError | yaml.YAMLError) -> str:
    """Where the file stops parsing (line and column, from 1) and why, on one line."""
    if isinstance(error, json.JSONDecodeError):
        return f"line {error.lineno}, column {error.colno}: {error.msg}"
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def parse_spec_text(text: str, *, source: str = "spec") -> Any:
    """The data of YAML (or JSON, which is YAML) spec text, within the limits above.

    Raises:
        SpecError: too long, too deep, an alias, or not valid YAML; the message starts with
            `source` and never repeats the text.
    """
    size_bytes = len(text.encode("utf-8", "surrogatepass"))
    if size_bytes > SPEC_TEXT_MAX_BYTES:
        raise SpecError(
            f"{source}: {size_bytes} bytes; a spec may have at most {SPEC_TEXT_MAX_BYTES}"
        )
    try:
        # The events first (no Python objects built): refused before any construction.
        depth = 0
        for event in yaml.parse(text, Loader=_LOADER):
            if isinstance(event, yaml.AliasEvent):
                raise SpecError(f"{source}: YAML aliases (*name) are not allowed in a spec")
            if isinstance(event, _OPENS):
                depth += 1
                if depth > SPEC_DEPTH_MAX:
                    raise SpecError(f"{source}: nested deeper than {SPEC_DEPTH_MAX} levels")
            elif isinstance(event, _CLOSES):
                depth -= 1
        return yaml.load(text, Loader=_LOADER)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as error:
        raise SpecError(f"{source}: not valid YAML: {_syntax_error(error)}") from None
    except ValueError as error:  # an integer of more digits than Python converts (4,300)
        raise SpecError(f"{source}: {error}") from None


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


def read_spec_data(path: str | Path) -> Any:
    """The parsed content of a YAML or JSON file (a spec, or a training config read as one).

    Raises:
        SpecError: the file is missing or unparsable.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SpecError(f"{path}: cannot read spec file ({error.strerror})") from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise SpecError(f"{path}: not valid json: {_syntax_error(error)}") from None
        except (RecursionError, ValueError) as error:
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise SpecError(f"{path}: not valid json: {first_line}") from None
    return parse_spec_text(text, source=str(path))


def load_spec(path: str | Path) -> Spec:
    """Read and validate a YAML or JSON spec file.

    Raises:
        SpecError: the file is missing, unparsable or invalid.
    """
    data = read_spec_data(path)
    try:
        return parse_spec(data)
    except SpecError as error:
        raise SpecError(f"{path}: {error}") from None
