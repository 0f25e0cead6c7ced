"""transformers' optimizer names (`TrainingArguments.optim`, Axolotl's `optimizer`) that a
measured optimizer stands for, with what differs."""

from __future__ import annotations

from autotune.core.configs.conversion import refuse
from autotune.core.exports.axolotl import OPTIMIZERS
from autotune.core.schemas import OptimizerName

# The export's names, read back; then the aliases with the same state per parameter.
_NAMED = {name: ours for ours, name in OPTIMIZERS.items()}
_ALIASES: dict[str, tuple[OptimizerName, str | None]] = {
    # One kernel for all parameters: no foreach temporaries, so at most the measured peak.
    "adamw_torch_fused": (OptimizerName.ADAMW, "measured as torch's foreach AdamW"),
    "adamw_hf": (OptimizerName.ADAMW, None),
    "adamw_8bit": (OptimizerName.ADAMW_8BIT, "measured as bitsandbytes' AdamW8bit"),
}


def optimizer_named(key: str, name: object) -> tuple[OptimizerName, str | None]:
    """The measured optimizer for a transformers optimizer name, and what differs (or None).

    Raises:
        SpecError: a name whose state autotune does not model, naming `key`.
    """
    if isinstance(name, str) and name in _NAMED:
        return _NAMED[name], None
    if isinstance(name, str) and name in _ALIASES:
        return _ALIASES[name]
    known = ", ".join([*_NAMED, *_ALIASES])
    raise refuse(key, f"{name!r}: autotune models {known}")
