"""A real OpenAI-compatible vLLM server for the end-to-end tests, started and
stopped by the test with the wheel's launcher (:mod:`kvmux.bench.server`, the
one the serving benchmark uses; it says why ``python -m
vllm.entrypoints.openai.api_server`` rather than ``vllm serve``), its log in a
file, every wait bounded by a :class:`Deadline`.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvmux.bench.server import (
    free_port,
    start_api_server,
    stop_group,
)

__all__ = [
    "Deadline",
    "Samples",
    "Server",
    "free_port",
    "metric",
    "scrape",
    "serve",
    "stop_group",
    "wait_healthy",
]


class Deadline:
    """A point in time every wait of a test is bounded by."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float:
        """Seconds left, at most ``cap``; TimeoutError once none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the test's time budget is spent")
        return left if cap is None else min(cap, left)

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.end


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base_url: str
    log: Path

    def tail(self, lines: int = 120) -> str:
        """The last ``lines`` lines of the server's log, headed by its path."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        body = "\n".join(text.splitlines()[-lines:])
        return f"--- server log, last {lines} lines ({self.log}) ---\n{body}"

    @contextmanager
    def shows_log(self) -> Iterator[None]:
        """Re-raise any failure inside with the tail of the server log."""
        try:
            yield
        except Exception as exc:
            raise AssertionError(f"{exc}\n{self.tail()}") from exc

    def wait_healthy(self, deadline: Deadline) -> None:
        with self.shows_log():
            wait_healthy(self, deadline)

    def post(self, path: str, deadline: Deadline, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.base_url + path, timeout=deadline.left(30), **kwargs)

    def get(self, path: str, deadline: Deadline) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=deadline.left(30))


@contextmanager
def serve(
    model: str,
    kv_transfer_config: dict[str, Any],
    workdir: Path,
    deadline: Deadline,
    model_flags: tuple[str, ...] = (),
    *,
    wait: bool = True,
) -> Iterator[Server]:
    """Start the server on a free loopback port, wait until ``/health``
    answers (failing with the log tail if the process exits or the deadline
    passes), yield it, and stop it whatever happened. ``wait=False`` yields
    it at once, to start several together (then :meth:`Server.wait_healthy`)."""
    port = free_port()
    log = workdir / "server.log"
    proc = start_api_server(model, model_flags, kv_transfer_config, log, port, cwd=workdir)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        if wait:
            server.wait_healthy(deadline)
        yield server
    finally:
        stop_group(proc)


def wait_healthy(server: Server, deadline: Deadline) -> None:
    """Return once the server answers ``/health``; fail if its process
    exits first or the deadline passes."""
    while True:
        code = server.proc.poll()
        if code is not None:
            raise RuntimeError(f"the server exited with code {code} before it was healthy")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if deadline.passed:
            raise TimeoutError("the server did not answer /health before the deadline")
        time.sleep(1)


Samples = dict[str, list[tuple[dict[str, str], float]]]
"""Parsed ``/metrics``: sample name -> [(labels, value)]."""


def metric(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when
    there are none: a counter nothing incremented is not exported)."""
    return sum(
        value
        for sample_labels, value in samples.get(name, [])
        if all(sample_labels.get(k) == v for k, v in labels.items())
    )


def scrape(server: Server, deadline: Deadline) -> Samples:
    """The server's ``/metrics``, parsed."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = server.get("/metrics", deadline)
    resp.raise_for_status()
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out
