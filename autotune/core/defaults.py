"""The defaults every deployable shares: the server's URL, the data directory and the database
files in it, the environment variables the commands read, and the exit codes of every command.

Only entry points (the commands, `api.settings`) read settings; they fall back to these values.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_SERVER_URL = "http://127.0.0.1:8000"
DEFAULT_DATA_DIR = Path("data")
# The server's database (runs), which `autotune tune` also records into by default.
SERVER_DATABASE_FILE = "autotune.db"
# A worker's own Optuna studies: not the server's file, since two processes writing one SQLite
# file would wait on each other's locks.
WORKER_STUDY_FILE = "worker-optuna.db"

# Per estimate run, traced in a worker's own process (`autotune worker --device estimate`, and
# the workers `autotune serve` runs): how long it may take, and how much it may grow the
# worker's resident memory; past either it fails saying so.
ESTIMATE_TIME_LIMIT_S = 300.0
ESTIMATE_MEMORY_LIMIT_BYTES = 4 * 2**30

ENV_SERVER_URL = "AUTOTUNE_SERVER"
ENV_TOKEN = "AUTOTUNE_TOKEN"
ENV_DATABASE_URL = "AUTOTUNE_DATABASE_URL"

EXIT_OK = 0
# A run failed, or something that may work next time (the database is down).
EXIT_FAILURE = 1
# The command line is wrong: the user must change it (bad option, bad spec, missing extra).
EXIT_USAGE = 2
# A wait ran out before what it waited for finished (as timeout(1) exits).
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130


def sqlite_url(data_dir: Path, file_name: str) -> str:
    """The SQLAlchemy URL of `file_name` in `data_dir` (created if missing), absolute, so that
    the URL names the same file from any working directory."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(data_dir / file_name).resolve()}"


def server_database_url(data_dir: Path = DEFAULT_DATA_DIR) -> str:
    """The embedded SQLite database of the server (and of `autotune tune`'s records)."""
    return sqlite_url(data_dir, SERVER_DATABASE_FILE)


def worker_study_url(data_dir: Path = DEFAULT_DATA_DIR) -> str:
    """A worker's own SQLite file for its Optuna studies."""
    return sqlite_url(data_dir, WORKER_STUDY_FILE)
