"""A real TCP relay to a service (Redis, PostgreSQL) that a test can cut, silence and bring back, to simulate an
outage; and a listener that accepts and never answers."""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlparse


class TcpProxy:
    """Relays 127.0.0.1:``port`` to ``target``. ``cut()`` drops every open connection and refuses new ones
    (each is closed at once) until ``restore()``; the port stays the same, so clients reconnect by themselves.
    ``silence()`` drops every open connection too, but accepts new ones and never answers them (a host that hangs,
    or a firewall that drops packets after the handshake): a client waits for its own timeout. ``freeze()`` is the
    same for the connections already open: they stay open and nothing more is relayed either way."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.down = False
        self.silent = False
        self.frozen = False
        threading.Thread(target=self._accept, daemon=True).start()

    @classmethod
    def to_redis(cls, redis_url: str) -> TcpProxy:
        target = urlparse(redis_url)
        return cls((target.hostname, target.port or 6379))

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            if self.silent or self.frozen:
                self.conns.append(client)  # held open, never read nor answered
                continue
            upstream = socket.create_connection(self.target)
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst) -> None:
        try:
            while data := src.recv(65536):
                if not self.frozen:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            # shutdown first: a bare close() neither wakes the other direction's recv() nor sends the FIN, so a
            # client that waits for the server to hang up (asyncpg after Terminate) would wait forever
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self) -> None:
        self.down = True
        conns, self.conns = self.conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass

    def silence(self) -> None:
        self.cut()
        self.down, self.silent = False, True

    def freeze(self) -> None:
        self.frozen = True

    def restore(self) -> None:
        self.down = self.silent = self.frozen = False

    def close(self) -> None:
        """Stop listening: new connections are refused (not accepted and dropped, as after ``cut``)."""
        self.cut()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (a bare close would not)
        except OSError:
            pass
        self.listener.close()


class SilentListener(TcpProxy):
    """A TCP port that accepts every connection and never sends a byte: a :class:`TcpProxy` silenced from the start,
    with no service behind it. Use it as a context manager; ``port`` is where to point a client."""

    def __init__(self):
        super().__init__(target=("127.0.0.1", 0))  # never dialled: a silent proxy only holds what it accepts
        self.silent = True

    def __enter__(self) -> SilentListener:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
