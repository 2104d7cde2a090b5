"""A TCP forwarder a test can cut, to take a real database away from a worker and give it back."""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    """Forwards <host>:<port> to a target; ``cut()`` drops every connection and refuses new ones.

    ``host`` is 127.0.0.1 unless told (another address lets a network namespace reach it).

    ``freeze()`` keeps every connection open (and accepts new ones) but passes no bytes until
    ``thaw()``: a hung server or a black-holed path, whose sockets this machine's kernel still
    acknowledges, so neither keepalives nor unacknowledged-data timeouts notice it.
    """

    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.host = host
        self.port = self._free_port(host)
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self._accepted = 0

    @staticmethod
    def _free_port(host: str) -> int:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def start(self) -> TcpProxy:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((self.host, self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()
        return self

    @property
    def accepted(self) -> int:
        """Connections accepted so far."""
        return self._accepted

    def freeze(self) -> None:
        """Stop passing bytes on every connection, old and new, without closing any."""
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        self._flowing.set()  # held chunks go to sockets that are closing
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, []
        if server is not None:
            # close() alone leaves the socket listening while the accept thread is blocked in
            # accept(); shutdown() wakes it, so the port can be bound again by start().
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            self._accepted += 1
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._server is not server:
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._flowing.wait()  # frozen: hold what arrived, pass nothing
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
