"""An in-process cache of finished runs, as the exact JSON bytes the API answers with.

A finished run (succeeded, failed, cancelled) never changes again: every later event is refused
under its stale lease and cancel refuses finished runs. So its serialised body can be kept and
served without touching the database, and a fingerprint that has a succeeded run keeps pointing
to it (a succeeded run is always found before a new one could be queued). Each server process has
its own cache; being a cache of immutable data, the processes cannot disagree.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from autotune.remote.protocol import RunStatus

CachedRun = tuple[RunStatus, bytes]


class FinishedRunCache:
    """LRU of run id -> (status, JSON body), plus fingerprint -> succeeded run id. Thread-safe."""

    def __init__(self, max_runs: int = 4096) -> None:
        self._max_runs = max_runs
        self._bodies: OrderedDict[int, CachedRun] = OrderedDict()
        self._succeeded: dict[str, int] = {}
        self._lock = threading.Lock()

    def body(self, run_id: int) -> CachedRun | None:
        with self._lock:
            found = self._bodies.get(run_id)
            if found is not None:
                self._bodies.move_to_end(run_id)
            return found

    def put_body(self, run_id: int, status: RunStatus, body: bytes) -> None:
        assert status.is_finished(), "only finished runs are immutable"
        with self._lock:
            self._bodies[run_id] = (status, body)
            self._bodies.move_to_end(run_id)
            while len(self._bodies) > self._max_runs:
                self._bodies.popitem(last=False)

    def succeeded_run(self, fingerprint: str) -> int | None:
        with self._lock:
            return self._succeeded.get(fingerprint)

    def put_succeeded(self, fingerprint: str, run_id: int) -> None:
        with self._lock:
            if len(self._succeeded) >= self._max_runs * 4:
                self._succeeded.clear()  # rare; it only costs one query per fingerprint again
            self._succeeded[fingerprint] = run_id
