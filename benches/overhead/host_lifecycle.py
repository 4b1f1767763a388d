"""P1h: P1's scheduler-side request lifecycles, with one child that does real
work in every hook: kvmux's host tier, ``KvmuxHostCache``.

vLLM's real v1 ``Scheduler`` (:class:`tests.support.sim.SchedulerSim`, one
worker whose host tier really copies blocks) runs 1,024 requests to
completion (256 with ``--quick``), with its scheduler-side connector built by
vLLM's connector factory: kvmux, or vLLM's ``MultiConnector``, over the one
child. The requests share 32 prefixes of 8 blocks in random order, and the
device KV cache is small (256 blocks for 16 running requests), so vLLM's own
prefix cache keeps losing the prefixes and the host tier serves them: its
lookups hit, it pins and loads, it reserves and commits every new full
block, and it evicts (LRU) once full.

Unlike P1's no-op children, the host tier is stateful, and it reads the live
``Request`` (computed tokens, block hashes) and vLLM's block table when
called, so replaying recorded calls on a fresh connector would not redo the
same work. Each timed repeat therefore runs the whole workload on a fresh
scheduler and connector, and times only the calls vLLM's scheduler makes
into its connector (every hook, outermost calls only): the connector's own
cost of the lifecycles, without the scheduler's or the workers'.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable
from typing import Any

from vllm.config import KVTransferConfig

from benches.overhead.case import Case
from benches.overhead.lifecycle import hooks
from tests.support.sim import BLOCK_SIZE, SchedulerSim

__all__ = ["build"]

HOST: dict[str, Any] = {
    "kv_connector": "KvmuxHostCache",
    "kv_connector_module_path": "kvmux",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"num_blocks": 4096},
}
DEVICE_BLOCKS = 256
PREFIXES, PREFIX_BLOCKS = 32, 8
MAX_NUM_SEQS = 16
MAX_TOKENS = 4


def _ktc(name: str, module: str | None) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [dict(HOST)]},
    )


def workload(n_req: int) -> list[list[int]]:
    """``n_req`` prompts: one of :data:`PREFIXES` shared prefixes (random
    order) and 1-4 blocks plus 5 tokens of their own."""
    rng = random.Random(0)
    prefixes = [
        [rng.randrange(1, 1000) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)] for _ in range(PREFIXES)
    ]
    return [
        rng.choice(prefixes)
        + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 5) * BLOCK_SIZE + 5)]
        for _ in range(n_req)
    ]


class Lifecycles:
    """One side: a fresh scheduler and connector per :meth:`__call__`, which
    runs the workload and returns the seconds spent in the connector's
    scheduler-side hooks."""

    def __init__(self, ktc: KVTransferConfig, prompts: list[list[int]]) -> None:
        self.ktc, self.prompts = ktc, prompts
        self.sim: SchedulerSim | None = None
        self.calls: list[str] = []
        self.lookups: list[tuple[int, bool]] = []
        self.per_hook: collections.defaultdict[str, float] = collections.defaultdict(float)
        """Seconds spent in each hook, summed over every run so far."""

    def __call__(self) -> float:
        if self.sim is not None:
            self.sim.close()
        sim = self.sim = SchedulerSim(self.ktc, num_blocks=DEVICE_BLOCKS, max_num_seqs=MAX_NUM_SEQS)
        conn = sim.scheduler.connector
        spent = [0.0]
        depth = [0]
        calls: list[str] = []
        lookups: list[tuple[int, bool]] = []

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*args: Any, **kwargs: Any) -> Any:
                if depth[0]:
                    return fn(*args, **kwargs)
                depth[0] = 1
                t0 = time.perf_counter()
                try:
                    out = fn(*args, **kwargs)
                finally:
                    took = time.perf_counter() - t0
                    spent[0] += took
                    self.per_hook[name] += took
                    depth[0] = 0
                calls.append(name)
                if name == "get_num_new_matched_tokens":
                    lookups.append(out)
                return out

            return timed

        for name in hooks():
            setattr(conn, name, wrap(name, getattr(conn, name)))
        for i, p in enumerate(self.prompts):
            sim.add(f"req-{i}", p, max_tokens=MAX_TOKENS)
        sim.run(max_steps=100_000)
        for name in hooks():
            delattr(conn, name)
        self.calls, self.lookups = calls, lookups
        return spent[0]

    def host(self) -> Any:
        """The host tier under the last run's connector."""
        if self.sim is None:
            raise RuntimeError("no lifecycle has run yet")
        conn = self.sim.connector
        return conn.sub_connectors[0]  # both sides have it (kvmux: an alias of children)


def build(quick: bool) -> Case:
    n_req = 256 if quick else 1024
    prompts = workload(n_req)
    kv = Lifecycles(_ktc("KvmuxConnector", "kvmux"), prompts)
    mc = Lifecycles(_ktc("MultiConnector", None), prompts)

    def check() -> None:
        kv()
        mc()
        rival = type(mc.sim.connector) if mc.sim else None
        if (
            rival is None
            or rival.__name__ != "MultiConnector"
            or not rival.__module__.startswith("vllm.")
        ):
            raise RuntimeError(f"the rival is {rival}, not vLLM's MultiConnector")
        if kv.calls != mc.calls or kv.lookups != mc.lookups:
            raise RuntimeError(
                "vLLM's scheduler called kvmux and MultiConnector differently on the same "
                f"workload: {len(kv.calls)} vs {len(mc.calls)} calls"
            )
        hits = sum(1 for n, _ in kv.lookups if n)
        for side in (kv, mc):
            host = side.host()
            st = host.index_stats()
            if st["pinned"] or st["writing"] or host.num_live_requests():
                raise RuntimeError(f"the host tier kept state after the lifecycles: {st}")
            if not st["ready"]:
                raise RuntimeError("the host tier stored nothing")
        if kv.sim is None or kv.sim.connector.num_live_requests():
            raise RuntimeError("kvmux kept per-request state after the lifecycles")
        loaded = sum(n for n, _ in kv.lookups)
        if hits < n_req // 4 or not loaded:
            raise RuntimeError(
                f"the host tier served too little: {hits} of {len(kv.lookups)} lookups hit"
            )
        notes["host_lookup_hits"] = hits
        notes["host_hit_tokens"] = loaded
        notes["lookups"] = len(kv.lookups)

    notes: dict[str, Any] = {
        "requests": n_req,
        "max_tokens": MAX_TOKENS,
        "prefixes": PREFIXES,
        "prefix_blocks": PREFIX_BLOCKS,
        "device_blocks": DEVICE_BLOCKS,
        "host_blocks": HOST["kv_connector_extra_config"]["num_blocks"],
        "timed": "seconds inside the scheduler-side connector hooks, one whole run per repeat",
    }
    return Case(
        key="P1h",
        title=f"scheduler side: request lifecycles, 1 child (host tier), {n_req} requests",
        kvmux=kv,
        rival=mc,
        rival_name="vLLM MultiConnector",
        unit=f"{n_req} requests through KvmuxHostCache (hook time only)",
        target=None,
        self_timed=True,
        check=check,
        notes=notes,
    )
