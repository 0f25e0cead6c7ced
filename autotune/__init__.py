"""autotune: the largest micro-batch that fits, and the accumulation that hits your batch fastest.

This package root stays torch-free; torch-backed modules (`zoo`, `workload`, `step`, `tracker`,
`device`, `probe`) are imported explicitly, and the Python API (`probe`, `tune`, `estimate`,
from `autotune.python_api`) on first use.
"""

from __future__ import annotations

from typing import Any

from autotune.core.errors import AutotuneError, ModelBuildError, SpecError
from autotune.core.schemas import ModelSpec, Spec, TrainingSpec

__all__ = [
    "AutotuneError",
    "ModelBuildError",
    "ModelSpec",
    "Spec",
    "SpecError",
    "TrainingSpec",
    "estimate",
    "probe",
    "tune",
]

_PYTHON_API = frozenset({"probe", "tune", "estimate"})


def __getattr__(name: str) -> Any:
    """`autotune.probe` and the others, imported (with torch) when first asked for."""
    if name in _PYTHON_API:
        from autotune import python_api

        return getattr(python_api, name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")


__version__ = "0.1.0"
