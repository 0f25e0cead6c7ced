"""Server settings (pydantic-settings, `AUTOTUNE_` prefix), read only by entry points.

`create_app(settings)` takes a `Settings`; nothing under `api/` reads the environment itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from autotune.core.defaults import DEFAULT_DATA_DIR, SERVER_DATABASE_FILE, server_database_url


class Settings(BaseSettings):
    """Everything the server can be told. Tokens accept a JSON list or comma-separated text."""

    model_config = SettingsConfigDict(env_prefix="AUTOTUNE_", extra="ignore")

    database_url: str | None = Field(
        default=None,
        description=f"SQLAlchemy URL; default: a SQLite file {SERVER_DATABASE_FILE} in data_dir.",
    )
    data_dir: Path = DEFAULT_DATA_DIR
    client_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Bearer tokens allowed to submit and cancel runs."
    )
    worker_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Bearer tokens allowed to use the worker protocol."
    )
    open_reads: bool = Field(default=False, description="Let anyone GET runs without a token.")
    allow_factory_specs: bool = Field(
        default=False,
        description="Accept specs whose model is a `factory` (code that workers started with "
        "--allow-factory import and run); refused with 422 otherwise.",
    )
    lease_s: float = Field(default=60.0, gt=0, description="How long a claim lasts unrenewed.")
    max_claims: int = Field(
        default=3, ge=1, description="Claims a run may use up (failures, expired leases)."
    )
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    database_connect_timeout_s: int = Field(
        default=3, ge=2, description="PostgreSQL: give up connecting after this many seconds."
    )
    database_statement_timeout_s: float = Field(
        default=30.0, gt=0, description="PostgreSQL: cancel any statement running longer."
    )
    health_timeout_s: float = Field(
        default=3.0, gt=0, description="GET /health answers 503 if the database takes longer."
    )
    max_wait_s: float = Field(default=300.0, ge=0, description="Cap on ?wait= long polls.")
    offer_window_s: float = Field(
        default=600.0,
        gt=0,
        description="A queued run whose device no worker offered within this many seconds "
        "says so (the run, the submit answer, the run page).",
    )
    wait_poll_s: float = Field(
        default=0.1,
        gt=0,
        description="How often the long-poll watcher reads the status of waited-for runs.",
    )

    @field_validator("client_tokens", "worker_tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [token.strip() for token in text.split(",") if token.strip()]
        return value

    def resolved_database_url(self) -> str:
        """The configured URL, or the embedded SQLite file (its directory is created)."""
        if self.database_url:
            return self.database_url
        return server_database_url(self.data_dir)
