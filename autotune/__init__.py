"""autotune: the largest micro-batch that fits, and the accumulation that hits your batch fastest.

This package root stays torch-free; torch-backed modules (`zoo`, `workload`, `step`, `tracker`,
`device`, `probe`) are imported explicitly.
"""

from __future__ import annotations

from autotune.core.errors import AutotuneError, ModelBuildError, SpecError
from autotune.core.schemas import ModelSpec, Spec, TrainingSpec

__all__ = [
    "AutotuneError",
    "ModelBuildError",
    "ModelSpec",
    "Spec",
    "SpecError",
    "TrainingSpec",
]

__version__ = "0.1.0"
