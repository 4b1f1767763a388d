"""A real LMCache multi-process (MP) server for the tests, on loopback only:
fixtures around :class:`kvmux.bench.lmcache.LMCacheServer` (the one
launcher, shared with the benchmarks: LMCache's own server as a subprocess
in its own process group on a free 127.0.0.1 port, stopped by its pid and
process group, never by name; chunk size the vLLM block size, 16, of
:mod:`tests.support.sim`), and :func:`time_limit` for fault tests.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmux.bench.lmcache import HOST, LMCacheServer, free_port
from kvmux.mux.config import lmcache_refusal

__all__ = [
    "HOST",
    "LMCacheServer",
    "TimeLimitExceeded",
    "free_port",
    "lmcache_refusal",
    "lmcache_runs",
    "lmcache_server",
    "model_dir",
    "own_lmcache_server",
    "skip_unless_lmcache_runs",
    "time_limit",
]


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


@pytest.fixture
def lmcache_runs() -> None:
    """Skips a test that serves through LMCache where kvmux refuses it at
    start-up (vLLM 0.34 with lmcache 0.5.6), saying why; the refusal itself
    is tested in ``tests/mux/test_lmcache_vllm034.py``."""
    skip_unless_lmcache_runs()


def skip_unless_lmcache_runs() -> None:
    """:func:`lmcache_runs` for a module- or session-scoped fixture."""
    _require_lmcache()
    why = lmcache_refusal()  # kvmux.mux.config's, cached
    if why is not None:
        pytest.skip(f"LMCache cannot serve on this vLLM; kvmux refuses it at start-up: {why}")


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
