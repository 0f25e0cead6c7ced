"""GET /health: the process is up and the database answers."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import ContextDep
from autotune.protocol import Health

router = APIRouter(tags=["health"])


@router.get("/health")
def read_health(context: ContextDep) -> Health:
    context.db.ping()
    return Health(status="ok", database="ok", version=context.version)
