"""A real LMCache multi-process (MP) server for the tests, on loopback only.

The server is LMCache's own ``python -m lmcache.v1.multiprocess.server``,
started as a subprocess in its own process group on a free 127.0.0.1 port,
with usage tracking off and ``--disable-metrics`` (otherwise it binds a
Prometheus port on all interfaces). It is stopped by its pid and process
group, never by name. Its chunk size equals the vLLM block size (16, that of
:mod:`kvmux.bench.sim`, unless given), as LMCache requires.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

HOST = "127.0.0.1"

#: Start-up is ~4 s on an idle 2-core machine; other jobs may share it.
START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


class LMCacheServer:
    """One LMCache MP server process: :meth:`start`, :meth:`kill` (the fault
    a crash would be), :meth:`stop`; :meth:`start` again restarts it on the
    same port."""

    def __init__(
        self,
        log_path: Path,
        port: int | None = None,
        chunk_size: int = 16,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.chunk_size = chunk_size  # must be vLLM's block size (kvmux.bench.sim.BLOCK_SIZE: 16)
        self.log_path = log_path
        # More server options, after the fixed ones (e.g. "--kv-event-log-size", "0").
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "lmcache.v1.multiprocess.server",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--chunk-size",
            str(self.chunk_size),
            "--l1-size-gb",
            "0.5",
            "--no-l1-use-lazy",
            "--eviction-policy",
            "LRU",
            "--disable-metrics",
            "--supported-transfer-mode",
            "auto",
            "--max-workers",
            "1",
            *self.extra_args,
        ]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LMCacheServer:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"LMCache server already running (pid {self.proc.pid})")
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false", LMCACHE_DISABLE_BANNER="1")
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps it open)
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group, stopped as one
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while not _accepts(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"LMCache server exited with {self.proc.returncode} while starting; "
                    f"log:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"LMCache server did not accept connections on {HOST}:{self.port} "
                    f"within {timeout_s} s; log:\n{self.log_tail()}"
                )
            time.sleep(0.2)
        return self

    def _signal(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the group start_new_session created
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the server and its process group, as a crash would end it."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        self._signal(signal.SIGTERM)
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def child(self, **extra: Any) -> dict[str, Any]:
        """A ``LMCacheMPConnector`` child config for this server."""
        cfg = {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": self.port, **extra}
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": cfg,
        }


class TimeLimitExceeded(BaseException):
    """A :func:`time_limit` ran out. Not an ``Exception``: LMCache catches
    ``TimeoutError`` around its own waits (a PREPARE_STORE waiting for a dead
    server, say) and kvmux wraps a child's ``Exception`` in
    ``KvmuxChildError``; neither may swallow or rename this one."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str = "test") -> Iterator[None]:
    """Raise :class:`TimeLimitExceeded` in the main thread if the block runs
    longer than ``seconds``: a fault test can fail, never hang CI. (SIGALRM
    interrupts blocking waits; the tests run in pytest's main thread.) Not
    nestable: an inner limit ends the outer one."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeLimitExceeded(f"{what} ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _require_lmcache() -> None:
    pytest.importorskip("lmcache.v1.multiprocess.server", reason="LMCache is not installed")


@pytest.fixture(scope="session")
def lmcache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    """One real LMCache MP server shared by the tests that only use it
    (each with its own model name, so their cache keys never collide)."""
    _require_lmcache()
    server = LMCacheServer(tmp_path_factory.mktemp("lmcache") / "server.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_lmcache_server(tmp_path: Path) -> Iterator[LMCacheServer]:
    """A real LMCache MP server of this test's own, for tests that kill and
    restart it."""
    _require_lmcache()
    server = LMCacheServer(tmp_path / "lmcache-server.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model folder of this test's own: its path is the model name LMCache
    puts in its keys, so no two tests share cache entries."""
    return tmp_path / "model"
