"""The parts other deployables plug into autotune, found through Python entry points:
`autotune.commands` (the server's `serve`, the worker's `worker`, ...) and `autotune.recorders`
(where `autotune tune` records a run). autotune names neither `api` nor `probes`: pyproject.toml
does, and an entry point's `[extra]` says what to install when its module cannot be imported.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from autotune.core.errors import ModelBuildError

COMMAND_GROUP = "autotune.commands"
RECORDER_GROUP = "autotune.recorders"
# A ModuleNotFoundError naming one of these is a bug in the project, never a missing extra.
OWN_PACKAGES = frozenset({"autotune", "api", "probes"})


@dataclass(frozen=True)
class Plugin:
    """One entry point: its name (a command's name, for commands) and the extra it needs."""

    name: str
    entry_point: EntryPoint

    @property
    def extra(self) -> str | None:
        extras = self.entry_point.extras
        return extras[0] if extras else None

    def load(self) -> object:
        """The object the entry point names; import errors propagate as they are."""
        return self.entry_point.load()


def plugins(group: str) -> list[Plugin]:
    """The entry points of `group`, sorted by name (installation order is arbitrary)."""
    found = entry_points(group=group)
    return [Plugin(ep.name, ep) for ep in sorted(found, key=lambda ep: ep.name)]


def is_missing_dependency(error: BaseException) -> bool:
    """True when `error` says a third-party module is not importable (an extra not installed),
    False for every other import error: a broken module of our own must show its own message."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return False
    return error.name.partition(".")[0] not in OWN_PACKAGES


def install_hint(extra: str | None) -> str:
    """What to run to get `extra`."""
    return f"pip install 'autotune[{extra}]'" if extra else "pip install autotune"


def import_extra(module_name: str, *, needed_for: str, extra: str) -> Any:
    """Import an optional dependency, or say which extra installs it.

    Raises:
        ModelBuildError: `module_name` is not installed.
    """
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelBuildError(
            f"{needed_for}: needs {module_name} ({exc}); install the `{extra}` extra: "
            f"{install_hint(extra)}"
        ) from exc
