"""P1: the scheduler side of whole request lifecycles through 3 no-op children.

vLLM's real v1 ``Scheduler`` (:class:`tests.support.sim.SchedulerSim`) runs a batch
of requests to completion once per side, with its scheduler-side connector
built by vLLM's connector factory (kvmux, or vLLM's ``MultiConnector``) over
three :class:`~tests.support.children.NoopConnector` children. Every call the
scheduler makes into its connector (lookups, allocations, per-step metadata,
worker output, stats, events, finishes, ...) is recorded with its real
arguments (``Request``, ``KVCacheBlocks``, ``SchedulerOutput``,
``KVConnectorOutput``). The timed operation replays that recorded sequence on
a fresh connector built by the same factory: the connector's own cost of the
lifecycles, without the scheduler's.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from benches.overhead.case import Case
from tests.support.sim import BLOCK_SIZE, SchedulerSim, kv_cache_config

__all__ = ["build", "children", "hooks", "record", "replayer"]

CHILD = {
    "kv_connector": "NoopConnector",
    "kv_connector_module_path": "tests.support.children",
    "kv_role": "kv_both",
}
NUM_BLOCKS = 1024


def children(n: int = 3) -> list[dict[str, Any]]:
    return [dict(CHILD) for _ in range(n)]


def _ktc(name: str, module: str | None) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children()},
    )


def hooks() -> list[str]:
    """Every public instance method of vLLM's connector interface (HMA's too)."""
    return [
        name
        for base in (KVConnectorBase_V1, SupportsHMA)
        for name, attr in vars(base).items()
        if not name.startswith("_") and inspect.isfunction(attr)
    ]


Call = tuple[str, tuple[Any, ...], dict[str, Any]]


def record(
    ktc: KVTransferConfig, prompts: list[list[int]], max_tokens: int
) -> tuple[Any, list[Call]]:
    """Run the requests through vLLM's scheduler; every call it makes into
    its connector, in order (not the connector's calls into itself)."""
    sim = SchedulerSim(ktc, num_blocks=NUM_BLOCKS, max_num_seqs=16)
    conn = sim.scheduler.connector
    calls: list[Call] = []
    depth = [0]

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def rec(*args: Any, **kwargs: Any) -> Any:
            if not depth[0]:
                calls.append((name, args, kwargs))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return rec

    for name in hooks():
        setattr(conn, name, wrap(name, getattr(conn, name)))
    for i, p in enumerate(prompts):
        sim.add(f"req-{i}", p, max_tokens=max_tokens)
    sim.run(max_steps=10_000)
    for name in hooks():
        delattr(conn, name)
    return sim, calls


def replayer(sim: Any, calls: list[Call]) -> tuple[Callable[[], None], Any]:
    """A fresh scheduler-side connector from vLLM's factory, and a function
    that replays ``calls`` on it."""
    conn = KVConnectorFactory.create_connector(
        config=sim.vllm_config,
        role=KVConnectorRole.SCHEDULER,
        kv_cache_config=kv_cache_config(NUM_BLOCKS),
    )
    conn.bind_kv_cache_manager(sim.scheduler.kv_cache_manager)
    seq = [(getattr(conn, name), args, kwargs) for name, args, kwargs in calls]

    def replay() -> None:
        for fn, args, kwargs in seq:
            fn(*args, **kwargs)

    return replay, conn


def build(quick: bool) -> Case:
    rng = random.Random(0)
    n_req = 16 if quick else 64
    max_tokens = 4
    prompts = [
        [rng.randrange(1, 1000) for _ in range(rng.randrange(2, 12) * BLOCK_SIZE + 5)]
        for _ in range(n_req)
    ]
    sims = {}
    calls = {}
    for side, ktc in (
        ("kvmux", _ktc("KvmuxConnector", "kvmux")),
        ("rival", _ktc("MultiConnector", None)),
    ):
        sims[side], calls[side] = record(ktc, prompts, max_tokens)
    names = {side: [c[0] for c in seq] for side, seq in calls.items()}
    if names["kvmux"] != names["rival"]:
        raise RuntimeError(
            "vLLM's scheduler called kvmux and MultiConnector differently on the same "
            f"workload: {len(names['kvmux'])} vs {len(names['rival'])} calls"
        )
    kv_replay, kv_conn = replayer(sims["kvmux"], calls["kvmux"])
    mc_replay, mc_conn = replayer(sims["rival"], calls["rival"])
    if type(mc_conn).__name__ != "MultiConnector" or not type(mc_conn).__module__.startswith(
        "vllm."
    ):
        raise RuntimeError(f"the rival is {type(mc_conn)}, not vLLM's MultiConnector")

    def check() -> None:
        kv_replay()
        if kv_conn.num_live_requests():
            raise RuntimeError("kvmux kept per-request state after the replayed lifecycles")

    per_hook: dict[str, int] = {}
    for n in names["kvmux"]:
        per_hook[n] = per_hook.get(n, 0) + 1
    return Case(
        key="P1",
        title="scheduler side: request lifecycles, 3 no-op children",
        kvmux=kv_replay,
        rival=mc_replay,
        rival_name="vLLM MultiConnector",
        unit=f"{n_req} requests ({len(names['kvmux'])} connector calls)",
        target=0.5,
        inner=1 if not quick else 2,
        check=check,
        notes={"requests": n_req, "max_tokens": max_tokens, "calls_per_hook": per_hook},
    )
