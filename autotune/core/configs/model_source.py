"""The model a config names (Axolotl's `base_model`, `--model`): a local directory holding a
transformers `config.json` (built from that config with random weights) or a hub id."""

from __future__ import annotations

import json
from pathlib import Path

from autotune.core.configs.conversion import refuse
from autotune.core.errors import SpecError
from autotune.core.hubid import hub_id_problem
from autotune.core.schemas import ModelSpec

# A checkpoint stored quantized (e.g. bitsandbytes' 4-bit) is not the bf16/fp32 model the
# emulated step builds from its config.
_QUANTIZED = "quantization_config"


def model_source(text: str, *, key: str) -> ModelSpec:
    """A `ModelSpec` for `text`, read where `key` names it.

    Raises:
        SpecError: neither a directory with `config.json` nor a hub id, or a quantized model.
    """
    path = Path(text).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except OSError:
            raise refuse(key, f"{text}: a directory without config.json") from None
        except json.JSONDecodeError as error:
            raise refuse(key, f"{config_path}: not valid JSON ({error.msg})") from None
        if not isinstance(config, dict):
            raise refuse(key, f"{config_path}: not a transformers config")
        if _QUANTIZED in config:
            raise refuse(
                key,
                f"{text} is stored quantized ({_QUANTIZED}), which autotune does not model",
            )
        # Fields a saved config carries that name no architecture (the weights' file layout).
        config.pop("_name_or_path", None)
        return _validated(key, hf_config=config)
    problem = hub_id_problem(text)
    if problem is not None:
        raise refuse(key, f"{text!r} is neither a local model directory nor a hub id ({problem})")
    return _validated(key, hf_id=text)


def _validated(key: str, **source: object) -> ModelSpec:
    from pydantic import ValidationError

    from autotune.core.specfile import describe_validation_error

    try:
        return ModelSpec.model_validate(source)
    except ValidationError as error:
        raise SpecError(f"{key}: {describe_validation_error(error)}") from None
