"""The long-poll watcher on a real database: a waiter wakes soon after its run finishes, a wait
ends at its timeout, and many waiters cost one status query per poll, not one each."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime

from sqlalchemy import event

from api.store import runstore
from api.store.db import Database, migrate
from api.store.runwatch import RunWatch
from autotune.remote.protocol import RunCreate
from tests.api_tests.factories import emulated, tiny_spec

POLL_S = 0.05


def _database_with_runs(db_url: str, count: int) -> tuple[Database, list[int]]:
    database = Database(db_url)
    migrate(database)
    now = datetime.now(UTC)
    with database.write() as session:
        ids = [
            runstore.create_run(
                session,
                request=RunCreate(spec=tiny_spec(seq_len=8 + i), device=emulated()),
                version="test",
                now=now,
            ).id
            for i in range(count)
        ]
    return database, ids


def _watch(database: Database) -> RunWatch:
    return RunWatch(database, clock=lambda: datetime.now(UTC), max_claims=3, poll_s=POLL_S)


def test_a_waiter_wakes_soon_after_its_run_finishes(db_url: str) -> None:
    database, [run_id, other_id] = _database_with_runs(db_url, 2)
    watch = _watch(database)
    cancelled_at: list[float] = []

    def cancel_later() -> None:
        deadline = time.monotonic() + 10
        while watch.watched < 2 and time.monotonic() < deadline:  # both waiters registered
            time.sleep(0.01)
        with database.write() as session:
            runstore.cancel_run(session, run_id=run_id, now=datetime.now(UTC))
        cancelled_at.append(time.monotonic())

    async def wait() -> tuple[bool, bool, float]:
        canceller = threading.Thread(target=cancel_later)
        canceller.start()
        other = asyncio.create_task(watch.wait_finished(other_id, 30))
        finished = await watch.wait_finished(run_id, 30)
        woke_at = time.monotonic()
        other_done = other.done()
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        canceller.join()
        return finished, other_done, woke_at

    finished, other_done, woke_at = asyncio.run(wait())
    assert finished
    assert not other_done  # only the finished run's waiters wake
    assert woke_at - cancelled_at[0] < 1.0  # within a few polls, not at the timeout
    assert watch.watched == 0
    database.dispose()


def test_a_wait_ends_at_its_timeout(db_url: str) -> None:
    database, [run_id] = _database_with_runs(db_url, 1)
    watch = _watch(database)
    started = time.monotonic()
    assert asyncio.run(watch.wait_finished(run_id, 0.4)) is False
    assert 0.4 <= time.monotonic() - started < 2.0
    assert watch.watched == 0
    database.dispose()


def test_many_waiters_share_one_status_query_per_poll(db_url: str) -> None:
    waiters = 100
    database, ids = _database_with_runs(db_url, waiters)
    watch = _watch(database)
    statements: list[str] = []
    event.listen(
        database.engine,
        "before_cursor_execute",
        lambda _c, _cur, statement, *_: statements.append(statement),
    )

    async def wait_all() -> list[bool]:
        return await asyncio.gather(*(watch.wait_finished(i, 1.0) for i in ids))

    started = time.monotonic()
    assert asyncio.run(wait_all()) == [False] * waiters
    polls = (time.monotonic() - started) / POLL_S
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    # One per poll (a waiter each would be 100 per poll).
    assert len(selects) <= polls + 2
    database.dispose()
