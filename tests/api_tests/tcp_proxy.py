"""A loopback TCP proxy in front of the real PostgreSQL that tests can make fail on demand.

Modes: FORWARD relays bytes both ways; REFUSE closes every connection (new ones at once, open
ones on the switch), which the driver sees as a failed connection; HANG accepts connections
and stops relaying, so the database "accepts connections but never answers". A proxy created
with no upstream is a listener that accepts and never replies.
"""

from __future__ import annotations

import socket
import threading
from enum import StrEnum


class Mode(StrEnum):
    FORWARD = "forward"
    REFUSE = "refuse"
    HANG = "hang"


class TcpProxy:
    def __init__(self, upstream: tuple[str, int] | None, mode: Mode = Mode.FORWARD) -> None:
        self._upstream = upstream
        self._mode = mode if upstream is not None else Mode.HANG
        self._changed = threading.Condition()
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def set_mode(self, mode: Mode) -> None:
        with self._changed:
            self._mode = mode
            if mode == Mode.REFUSE:
                self._close_connections()
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._close_connections()
            self._changed.notify_all()
        self._listener.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _close_connections(self) -> None:
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._sockets.clear()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._changed:
                if self._mode == Mode.REFUSE or self._closed:
                    client.close()
                    continue
                self._sockets.append(client)
                if self._upstream is None:
                    continue
                upstream = socket.create_connection(self._upstream)
                self._sockets.append(upstream)
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                with self._changed:
                    # While hanging, hold the bytes: the peer waits and never hears back.
                    self._changed.wait_for(lambda: self._mode != Mode.HANG or self._closed)
                    if self._closed:
                        return
                target.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
