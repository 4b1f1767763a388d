"""A real Redis server on loopback, in memory only: the store several
instances' LMCache servers share as their L2 (LMCache 0.5.6's ``resp``
adapter), for the fleet benchmark and the many-instances tests.

Debian's ``redis-server``, in its own process group on a free 127.0.0.1 port,
nothing persisted. :meth:`RedisServer.kill` is the fault a crash would be;
:meth:`RedisServer.start` again restarts it, empty, on the same port.
"""

from __future__ import annotations

import atexit
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from kvmux.bench.server import HOST, free_port, stop_group

__all__ = ["RedisServer", "resp_adapter", "unavailable"]

START_TIMEOUT_S = 60.0


def unavailable() -> str | None:
    """Why Redis cannot be run here (None: it can)."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (Debian: apt-get install redis-server)"
    return None


def resp_adapter(port: int, host: str = HOST) -> dict[str, Any]:
    """LMCache's ``--l2-adapter`` for a Redis at ``host:port``."""
    return {"type": "resp", "host": host, "port": port}


class RedisServer:
    """One ``redis-server`` process: :meth:`start`, :meth:`kill`, :meth:`stop`,
    :meth:`command`. A context manager (start on entry, stop on exit)."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> RedisServer:
        why = unavailable()
        if why is not None:
            raise RuntimeError(why)
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"redis-server already running (pid {self.proc.pid})")
        argv = [str(shutil.which("redis-server")), "--port", str(self.port), "--bind", HOST]
        argv += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        atexit.register(self.stop)
        end = time.monotonic() + timeout_s
        while True:
            try:
                if self.command("PING") == "PONG":
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(
                    f"redis-server did not start on {HOST}:{self.port}: "
                    f"{self.log_path.read_text(errors='replace')[-800:]}"
                )
            time.sleep(0.1)

    def command(self, *words: str) -> str | int:
        """One RESP command; its simple-string or integer reply."""
        msg = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
        with socket.create_connection((HOST, self.port), timeout=5) as s:
            s.sendall(msg.encode())
            reply = s.recv(4096).decode()
        kind, body = reply[:1], reply[1:].split("\r\n", 1)[0]
        if kind == ":":
            return int(body)
        if kind == "+":
            return body
        raise RuntimeError(f"redis answered {reply!r}")

    def keys(self) -> int:
        """How many keys the store holds."""
        return int(self.command("DBSIZE"))

    def kill(self) -> None:
        """SIGKILL the server, as a crash would end it (what it held is gone)."""
        if self.proc is not None and self.proc.poll() is None:
            stop_group(self.proc, grace_s=5, first=signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace_s=5)
        atexit.unregister(self.stop)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
