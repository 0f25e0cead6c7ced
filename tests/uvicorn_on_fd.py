"""Serves `api.main` with uvicorn on a listening TCP socket inherited as a file descriptor.

`uvicorn --fd N` wraps the descriptor as an AF_UNIX socket (`socket.fromfd(fd, AF_UNIX, ...)`),
so asyncio never sets TCP_NODELAY on the connections it accepts: every response written in two
parts then waits for the client's delayed ACK, 40 ms a request on loopback, which is what the
live tests measured instead of the server. `socket.socket(fileno=N)` reads the real family.

Usage: python tests/uvicorn_on_fd.py FD
"""

from __future__ import annotations

import socket
import sys

import uvicorn


def main() -> None:
    listening = socket.socket(fileno=int(sys.argv[1]))
    config = uvicorn.Config("api.main:create_app_from_env", factory=True, log_level="warning")
    uvicorn.Server(config).run(sockets=[listening])


if __name__ == "__main__":
    main()
