"""What the workers offer: every claim reports the worker's devices, and the worker's row keeps
them with the last time it was seen (`leases._record_worker`; heartbeats refresh the time, as
a busy worker still holds its devices). A run that waits for a device no worker has offered
lately would wait silently: `offer_notice` says so, and `offered_devices` are the submit
form's defaults."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.store.tables import WorkerRow
from autotune.core.schemas import DeviceInfo
from autotune.remote.protocol import DeviceTarget


def offered_devices(session: Session, *, now: datetime, window_s: float) -> list[DeviceInfo]:
    """The devices of every worker seen within `window_s` before `now`, most recent first."""
    since = now - timedelta(seconds=window_s)
    rows = session.scalars(
        select(WorkerRow)
        .where(WorkerRow.last_seen_at >= since)
        .order_by(WorkerRow.last_seen_at.desc())
    )
    return [DeviceInfo.model_validate(device) for row in rows for device in row.devices]


def offer_notice(
    session: Session, target: DeviceTarget, *, now: datetime, window_s: float
) -> str | None:
    """A sentence for a run waiting on `target` when no worker offered it within `window_s`,
    else None."""
    if any(
        target.matches(device) for device in offered_devices(session, now=now, window_s=window_s)
    ):
        return None
    minutes = max(1, round(window_s / 60))
    return (
        f"no worker has offered this device ({target.label}) in the last {minutes} minutes: "
        "the run waits until one does (start one with `autotune worker` and a matching "
        "--device/--memory/--gpu)"
    )
