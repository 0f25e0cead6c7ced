"""Recording a run tuned in this process (`autotune tune`) where the server shows it: the
`RunRecorder` contract, which autotune owns and the server package implements (`api.local`),
registered under the `autotune.recorders` entry points (see `autotune.core.plugins`).
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from autotune.core.plugins import RECORDER_GROUP, is_missing_dependency, plugins
from autotune.core.schemas import TuneResult

logger = logging.getLogger(__name__)


@runtime_checkable
class RunRecorder(Protocol):
    """Stores a finished `TuneResult` as a run in the database at `database_url`.

    Called once per `autotune tune`, after the tuning: it may migrate the database first, must
    store the run in one transaction, and returns the id the run got there. Errors propagate.
    """

    def record_run(self, database_url: str, result: TuneResult) -> int: ...


def installed_recorders() -> list[RunRecorder]:
    """One instance of each installed recorder. A recorder whose extra is not installed (no
    server package here) is skipped: recording is optional. Any other error surfaces."""
    recorders: list[RunRecorder] = []
    for plugin in plugins(RECORDER_GROUP):
        try:
            factory = plugin.load()
        except ImportError as error:
            if not is_missing_dependency(error):
                raise
            logger.debug("recorder %s unavailable: %s", plugin.name, error)
            continue
        if not callable(factory):
            raise TypeError(f"{plugin.entry_point.value}: not a RunRecorder class")
        recorder = factory()
        if not isinstance(recorder, RunRecorder):
            raise TypeError(f"{plugin.entry_point.value}: not a RunRecorder")
        recorders.append(recorder)
    return recorders
