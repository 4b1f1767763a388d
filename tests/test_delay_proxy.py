"""The fault tests' delaying proxy (``tests/delay_proxy.py``) against a
loopback echo server: replies late by the delay, in order, byte for byte;
held while paused; connections dropped; stopped and started again on the
same port."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.delay_proxy import HOST, DelayProxy


@pytest.fixture
def echo_port():
    srv = socket.socket()
    srv.bind((HOST, 0))
    srv.listen()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1]
    srv.shutdown(socket.SHUT_RDWR)
    srv.close()


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        assert chunk, "connection closed"
        out += chunk
    return out


def round_trip(conn: socket.socket, data: bytes) -> float:
    t0 = time.monotonic()
    conn.sendall(data)
    assert recv_exactly(conn, len(data)) == data
    return time.monotonic() - t0


def test_replies_come_late_by_the_delay_in_order(echo_port):
    with DelayProxy(echo_port, delay_s=0.3) as proxy:
        conn = socket.create_connection((HOST, proxy.port), timeout=5)
        assert 0.3 <= round_trip(conn, b"ping") < 2
        proxy.delay_s = 0.0
        big = bytes(range(256)) * 2000  # 512 KB, many reads
        assert round_trip(conn, big) < 2
        conn.close()


def test_paused_replies_are_held_then_delivered(echo_port):
    with DelayProxy(echo_port) as proxy:
        conn = socket.create_connection((HOST, proxy.port), timeout=5)
        proxy.pause()
        conn.sendall(b"held")
        conn.settimeout(0.3)
        with pytest.raises(TimeoutError):
            conn.recv(4)
        proxy.resume()
        conn.settimeout(5)
        assert recv_exactly(conn, 4) == b"held"


def test_drop_closes_connections_and_new_ones_are_accepted(echo_port):
    with DelayProxy(echo_port) as proxy:
        conn = socket.create_connection((HOST, proxy.port), timeout=5)
        round_trip(conn, b"a")
        proxy.drop()
        assert conn.recv(1) == b""
        assert proxy.open_connections == 0
        again = socket.create_connection((HOST, proxy.port), timeout=5)
        round_trip(again, b"b")
        assert proxy.connections == 2


def test_stopped_it_refuses_then_starts_again_on_the_same_port(echo_port):
    proxy = DelayProxy(echo_port).start()
    port = proxy.port
    conn = socket.create_connection((HOST, port), timeout=5)
    round_trip(conn, b"x")
    proxy.stop()
    assert conn.recv(1) == b""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, port), timeout=5)
    proxy.start()
    try:
        assert proxy.port == port
        round_trip(socket.create_connection((HOST, port), timeout=5), b"c")
    finally:
        proxy.stop()
    left = [t.name for t in threading.enumerate() if t.name.startswith("delay-proxy")]
    assert not left, left


def test_a_server_that_is_down_closes_the_client_connection(echo_port):
    with DelayProxy(echo_port) as proxy:
        proxy.upstream_port = _closed_port()
        conn = socket.create_connection((HOST, proxy.port), timeout=5)
        assert conn.recv(1) == b""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]
