"""A loopback TCP proxy that delays replies: a slow or hung server, made
from a healthy one, for fault tests.

``DelayProxy(upstream_port).start()`` listens on its own free 127.0.0.1
port and forwards every connection to ``127.0.0.1:upstream_port``. What the
client sends goes through at once; what the server answers reaches the
client ``delay_s`` seconds after it arrived here (in order, byte for byte),
so every request/response round trip takes ``delay_s`` longer. Settable at
any time:

- :attr:`delay_s`: the reply delay, for replies that arrive from then on;
- :meth:`pause` / :meth:`resume`: hold every reply (a hung server: the
  connections stay up, nothing comes back), then deliver them;
- :meth:`drop`: close every open connection (a network blip); new ones are
  accepted;
- :meth:`stop`: stop listening and close every connection.

It knows nothing of the protocol (LMCache's ZeroMQ here), so a client
reconnecting after :meth:`drop` gets a fresh connection to the server.
Everything runs in daemon threads started by :meth:`start` and joined by
:meth:`stop`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque

HOST = "127.0.0.1"
_CHUNK = 1 << 16


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class _Link:
    """One client connection and its upstream connection: requests pumped
    straight through, replies queued with the time they are due."""

    def __init__(self, proxy: DelayProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.replies: deque[tuple[float, bytes | None]] = deque()  # None: upstream closed
        self.cond = threading.Condition()
        self.closed = False
        self.threads = [
            threading.Thread(target=self._requests, name="delay-proxy-req", daemon=True),
            threading.Thread(target=self._read_replies, name="delay-proxy-rep", daemon=True),
            threading.Thread(target=self._write_replies, name="delay-proxy-out", daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _requests(self) -> None:
        try:
            while data := self.client.recv(_CHUNK):
                self.upstream.sendall(data)
        except OSError:
            pass
        self.close()

    def _read_replies(self) -> None:
        last_due = 0.0
        try:
            while True:
                data = self.upstream.recv(_CHUNK)
                # Never overtake an earlier reply, whatever the delay now is.
                last_due = max(last_due, time.monotonic() + self.proxy.delay_s)
                with self.cond:
                    self.replies.append((last_due, data or None))
                    self.cond.notify_all()
                if not data:
                    return
        except OSError:
            self.close()

    def _write_replies(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (not self.replies or self.proxy.paused):
                    self.cond.wait(0.05)
                if self.closed:
                    return
                due, data = self.replies[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self.cond.wait(min(wait, 0.05))
                    continue
                self.replies.popleft()
            if data is None:  # the server closed: so does the client's connection
                self.close()
                return
            try:
                self.client.sendall(data)
            except OSError:
                self.close()
                return

    def close(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        _close(self.client)
        _close(self.upstream)
        self.proxy._forget(self)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout)


class DelayProxy:
    """A proxy on ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>`` that
    delays replies by :attr:`delay_s` seconds (see the module docstring)."""

    def __init__(self, upstream_port: int, delay_s: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.paused = False
        self.port = 0
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._links: set[_Link] = set()  # open ones
        self._closed_links: list[_Link] = []  # closed, threads not yet joined
        self._lock = threading.Lock()
        self.connections = 0  # accepted so far (each client reconnect is one more)

    def start(self) -> DelayProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST, self.port))  # the same port again after stop()
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._accepter = threading.Thread(target=self._accept, name="delay-proxy", daemon=True)
        self._accepter.start()
        return self

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None  # set by start(), before this thread
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # stop() closed the listener
                return
            try:
                upstream = socket.create_connection((HOST, self.upstream_port), timeout=2)
            except OSError:  # the server is down: so is this connection
                _close(client)
                continue
            upstream.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(self, client, upstream)
            with self._lock:  # known before it runs: drop() and stop() find every link
                self.connections += 1
                self._links.add(link)
            link.start()

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)
            self._closed_links.append(link)

    def _each_link(self) -> list[_Link]:
        with self._lock:
            return list(self._links)

    def _notify(self) -> None:
        for link in self._each_link():
            with link.cond:
                link.cond.notify_all()

    def pause(self) -> None:
        """Hold every reply until :meth:`resume` (a hung server)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._notify()

    def drop(self) -> None:
        """Close every open connection; keep accepting new ones."""
        with self._lock:
            links = [*self._links, *self._closed_links]
            self._closed_links = []
        for link in links:
            link.close()
        for link in links:  # their threads, including any still closing itself
            link.join(5)

    def stop(self) -> None:
        """Stop listening and close every connection."""
        if self._listener is not None:
            _close(self._listener)
            self._listener = None
        if self._accepter is not None:
            self._accepter.join(5)
            self._accepter = None
        self.drop()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._links)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
