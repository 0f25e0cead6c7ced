"""The training configs people already keep, read as specs (docs/design.md#config-files).

`autotune probe|tune|submit FILE` takes, besides a spec, an Axolotl YAML, a Hugging Face
`TrainingArguments` JSON or a DeepSpeed JSON, told apart by their content (`reading`). One
module per format turns it into a `Spec` and names what it could not map (`axolotl`,
`hf_args`, `deepspeed`; ranks and layout: `ranks`, `fsdp`); what cannot be modelled at all is
refused with the field named.
`writeback` puts a recommendation back into the same file, keeping everything else.
Torch-free: the client (`autotune submit`) reads these files too.
"""

from __future__ import annotations

from autotune.core.configs.conversion import ConfigFormat, Converted
from autotune.core.configs.ranks import RankOptions
from autotune.core.configs.reading import load_training_file

__all__ = ["ConfigFormat", "Converted", "RankOptions", "load_training_file"]
