"""A real LMCache multi-process (MP) server on loopback only, which the
benchmarks that compare against LMCache start (``bench serve``, ``bench
fleet``, and from a source checkout the overhead comparison C1L); the tests
reuse it (``tests/support/lmcache_server.py``).

LMCache's own ``python -m lmcache.v1.multiprocess.server``: a subprocess in
its own process group on a free 127.0.0.1 port, usage tracking off,
``--disable-metrics`` (otherwise it binds a Prometheus port on all
interfaces), chunk size vLLM's block size (as LMCache requires; by default
:data:`CHUNK_SIZE`, vLLM's default block size on a GPU). It is stopped by its
pid and process group, never by name: by :meth:`LMCacheServer.stop`, at
interpreter exit if still running (a benchmark runner may have no tear-down
hook), and, should its parent be killed outright, by the kernel (Linux's
parent-death signal).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["HOST", "LMCacheServer", "free_port", "unavailable"]

# Imports only the standard library: listing the benchmarks asks unavailable().

HOST = "127.0.0.1"
#: Start-up is ~4 s on an idle 2-core machine; other jobs may share it.
START_TIMEOUT_S = 120.0
SERVER_MODULE = "lmcache.v1.multiprocess.server"
#: The chunk size when none is given: vLLM's default block size on a GPU (16),
#: the block size of the scheduler the tests and the overhead benchmarks run.
CHUNK_SIZE = 16


def unavailable() -> str | None:
    """Why the LMCache server cannot be run here (None: it can). Only looks
    for the package: importing LMCache takes seconds (see :func:`refused`)."""
    try:
        found = importlib.util.find_spec("lmcache") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "LMCache is not installed (pip install lmcache; tested: 0.5.6)"


def refused() -> str | None:
    """Why kvmux refuses LMCache as a child on the installed vLLM (lmcache
    0.5.6 on vLLM 0.34), or None: asked only when benchmarks run, since on
    such a vLLM it imports vLLM and LMCache."""
    from kvmux import _versions

    if _versions.HAS_RESUMED_REQ_IDS:
        return None
    from kvmux.mux.config import lmcache_refusal

    why = lmcache_refusal()
    return None if why is None else f"kvmux refuses LMCache on this vLLM at start-up: {why}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """Linux: SIGKILL this process when the bench that started it dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LMCacheServer:
    """One LMCache MP server process: :meth:`start`, :meth:`kill` (the fault
    a crash would be), :meth:`stop`; :meth:`start` again restarts it on the
    same port. A context manager (:meth:`start` on entry, :meth:`stop` on
    exit). Its log goes to ``log_path``, or to a temporary folder of its own
    that goes with the object."""

    def __init__(
        self,
        log_path: Path | None = None,
        port: int | None = None,
        chunk_size: int | None = None,
        l1_size_gb: float = 0.5,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.chunk_size = chunk_size or CHUNK_SIZE  # must be vLLM's block size
        self.l1_size_gb = l1_size_gb
        # More server options, after the fixed ones (e.g. "--kv-event-log-size", "0").
        self.extra_args = list(extra_args)
        self._dir = None
        if log_path is None:
            self._dir = tempfile.TemporaryDirectory(prefix="kvmux-lmcache-")
            log_path = Path(self._dir.name) / "server.log"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            SERVER_MODULE,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--chunk-size",
            str(self.chunk_size),
            "--l1-size-gb",
            str(self.l1_size_gb),
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
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        finally:
            log.close()
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        try:
            while not _accepts(self.port):
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"LMCache server exited with {self.proc.returncode} while starting; "
                        f"log:\n{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"LMCache server did not accept connections on {HOST}:{self.port} "
                        f"within {timeout_s} s; log:\n{self.log_tail()}"
                    )
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def _signal(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)  # the group start_new_session created

    def kill(self) -> None:
        """SIGKILL the server and its process group, as a crash would end it."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after 10 s.
        Idempotent; :meth:`start` may run it again."""
        if self.proc is not None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        atexit.unregister(self.stop)

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if self._dir is not None:
            self._dir.cleanup()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def child(self, name: str | None = None, **extra: Any) -> dict[str, Any]:
        """A ``LMCacheMPConnector`` child entry for this server (with kvmux's
        ``name`` when given; without, it is also a ``KVTransferConfig``)."""
        cfg = {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": self.port, **extra}
        return {
            **({"name": name} if name is not None else {}),
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": cfg,
        }
