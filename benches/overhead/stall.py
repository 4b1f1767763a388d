"""S1: time to schedule while one child stalls, kvmux's lookup deadline
against vLLM's ``MultiConnector`` (which has none).

Two children on both sides, in this order: kvmux's host tier
(``KvmuxHostCache``, its worker really copying blocks) and a
:class:`~tests.support.children.StallConnector`, a cache that answers each
request's lookup "not ready" for :data:`STALL_MS` of wall time, then a miss
(a cache server answering slowly). kvmux gives the stalling child
``lookup_timeout_ms`` = :data:`DEADLINE_MS` in its entry: past it, the child
is a miss for that request and the request goes on with the host tier.
Everything else is kvmux's default, the stalling child's circuit breaker
included: after 3 missed deadlines it opens, requests skip the child without
waiting at all, and after each cooldown (1 s, doubling) one request probes
it and waits out the deadline again. ``MultiConnector`` answers "not ready"
for as long as any child does, so its requests wait out the stall.

vLLM's real v1 ``Scheduler`` (:class:`tests.support.sim.SchedulerSim`) runs an
open-loop workload in wall time: requests arrive at seeded exponential
intervals (a Poisson stream) with P1h's prompts (32 shared prefixes that
vLLM's small device cache keeps losing, so the host tier serves hits), and
decode 4 tokens each; a step that schedules work lasts at least
:data:`STEP_MS` (the model's forward, which this machine does not run), a
step that schedules nothing is followed by a :data:`POLL_MS` pause. A
request's time to schedule runs from its arrival to the end of the
``schedule()`` call that first schedules it. Each repeat runs the whole
workload on a fresh scheduler and connector and reports that repeat's p50
and p99; the table has a row for each.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from vllm.config import KVTransferConfig

from benches.overhead import host_lifecycle
from benches.overhead.case import Case
from tests.support.sim import SchedulerSim

__all__ = ["DEADLINE_MS", "STALL_MS", "build"]

STALL_MS = 250.0
"""How long the stalling child answers each request "not ready"."""
DEADLINE_MS = 50.0
"""kvmux's ``lookup_timeout_ms`` on the stalling child."""
STEP_MS = 5.0
"""Least duration of a step that schedules work (the model's forward)."""
POLL_MS = 1.0
"""Pause after a step that scheduled nothing (the engine loop polling)."""
MEAN_INTERVAL_MS = 4.0
"""Mean time between arrivals."""
MAX_NUM_SEQS = 16
MAX_TOKENS = 4
DEVICE_BLOCKS = host_lifecycle.DEVICE_BLOCKS

HOST = {
    "kv_connector": "KvmuxHostCache",
    "kv_connector_module_path": "kvmux",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"num_blocks": 4096},
}
STALL = {
    "kv_connector": "StallConnector",
    "kv_connector_module_path": "tests.support.children",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"stall_ms": STALL_MS},
}


def _ktc(name: str, module: str | None, deadline_ms: float | None) -> KVTransferConfig:
    stall: dict[str, Any] = dict(STALL)
    if deadline_ms is not None:
        stall["lookup_timeout_ms"] = deadline_ms
    return KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [dict(HOST), stall]},
    )


def workload(n_req: int) -> tuple[list[list[int]], list[float]]:
    """P1h's ``n_req`` prompts (one of 32 shared prefixes of 8 blocks, then
    1-4 blocks and 5 tokens of their own: on a device cache of
    :data:`DEVICE_BLOCKS` vLLM keeps losing the prefixes and the host tier
    serves them) and their arrival times in seconds from the start
    (exponential intervals, mean :data:`MEAN_INTERVAL_MS`)."""
    rng = random.Random(1)
    arrivals, t = [], 0.0
    for _ in range(n_req):
        arrivals.append(t)
        t += rng.expovariate(1000 / MEAN_INTERVAL_MS)
    return host_lifecycle.workload(n_req), arrivals


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between order statistics)."""
    if len(xs) == 1:
        return xs[0]
    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    return cuts[round(q * 100) - 1]


class Arrivals:
    """One side: each call runs the workload in wall time on a fresh
    scheduler and connector and returns that run's p50 and p99 time to
    schedule, in seconds."""

    def __init__(
        self, ktc: KVTransferConfig, prompts: list[list[int]], arrivals: list[float]
    ) -> None:
        self.ktc, self.prompts, self.arrivals = ktc, prompts, arrivals
        self.sim: SchedulerSim | None = None
        self.waits: list[float] = []
        """The last run's time to schedule of each request, in arrival order."""

    def run(self, timeout_s: float = 60.0) -> list[float]:
        if self.sim is not None:
            self.sim.close()
        sim = self.sim = SchedulerSim(self.ktc, num_blocks=DEVICE_BLOCKS, max_num_seqs=MAX_NUM_SEQS)
        sched = sim.scheduler
        first: dict[str, float] = {}
        schedule = sched.schedule

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:
            so = schedule(*args, **kwargs)
            now = time.monotonic()
            for r in so.scheduled_new_reqs:
                first.setdefault(r.req_id, now)
            return so

        sched.schedule = timed_schedule  # type: ignore[method-assign]
        n = len(self.prompts)
        t0 = time.monotonic()
        due = [t0 + a for a in self.arrivals]
        added = 0
        while True:
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise TimeoutError(
                    f"the workload did not drain in {timeout_s} s: "
                    f"{len(first)} of {n} requests scheduled"
                )
            while added < n and due[added] <= now:
                sim.add(f"req-{added}", self.prompts[added], max_tokens=MAX_TOKENS)
                added += 1
            if not sched.has_requests() and not sched.requests:
                if added == n:
                    break
                time.sleep(max(0.0, due[added] - time.monotonic()))
                continue
            so = sim.step()
            if so.num_scheduled_tokens:
                left = STEP_MS / 1000 - (time.monotonic() - now)
                if left > 0:
                    time.sleep(left)
            else:
                time.sleep(POLL_MS / 1000)
        del sched.schedule
        self.waits = [first[f"req-{i}"] - due[i] for i in range(n)]
        return self.waits

    def __call__(self) -> dict[str, float]:
        waits = self.run()
        return {"p50": quantile(waits, 0.5), "p99": quantile(waits, 0.99)}

    def children(self) -> list[Any]:
        if self.sim is None:
            raise RuntimeError("no run yet")
        return list(self.sim.connector.sub_connectors)


def build(quick: bool) -> Case:
    n_req = 48 if quick else 128
    prompts, arrivals = workload(n_req)
    kv = Arrivals(_ktc("KvmuxConnector", "kvmux", DEADLINE_MS), prompts, arrivals)
    mc = Arrivals(_ktc("MultiConnector", None, None), prompts, arrivals)
    notes: dict[str, Any] = {
        "requests": n_req,
        "stall_ms": STALL_MS,
        "lookup_timeout_ms": DEADLINE_MS,
        "step_ms": STEP_MS,
        "poll_ms": POLL_MS,
        "mean_interval_ms": MEAN_INTERVAL_MS,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_tokens": MAX_TOKENS,
        "children": ["KvmuxHostCache", "StallConnector"],
        "timed": "per request: arrival -> end of the schedule() call that first schedules it",
    }

    def check() -> None:
        kv.run()
        mc.run()
        rival = type(mc.sim.connector) if mc.sim else None
        if (
            rival is None
            or rival.__name__ != "MultiConnector"
            or not rival.__module__.startswith("vllm.")
        ):
            raise RuntimeError(f"the rival is {rival}, not vLLM's MultiConnector")
        for name, side in (("kvmux", kv), ("MultiConnector", mc)):
            host, stall = side.children()
            if not stall.stalled or stall.first_asked:
                raise RuntimeError(
                    f"{name}: the stalling child answered {stall.stalled} lookups not ready "
                    f"and still holds {len(stall.first_asked)} requests"
                )
            st = host.index_stats()
            if st["pinned"] or st["writing"] or host.num_live_requests():
                raise RuntimeError(f"{name}: the host tier kept state after the run: {st}")
        if min(mc.waits) < STALL_MS / 1000:
            raise RuntimeError("a MultiConnector request was scheduled before the stall ended")
        if kv.sim is None or kv.sim.connector.num_live_requests():
            raise RuntimeError("kvmux kept per-request state after the run")
        counts = kv.sim.connector.mux_stats()["children"]
        timeouts = sum(c.get("lookup_timeouts", 0) for c in counts.values())
        if not timeouts:
            raise RuntimeError("kvmux's lookup deadline never expired: nothing to compare")
        notes["kvmux_lookup_timeouts"] = timeouts
        for key in ("breaker_opens", "breaker_skips"):
            notes[f"kvmux_{key}"] = sum(c.get(key, 0) for c in counts.values())
        notes["kvmux_host_tier_hits"] = sum(
            c.get("hits", 0) for name, c in counts.items() if "HostCache" in name
        )

    return Case(
        key="S1",
        title=f"time to schedule, 1 of 2 children stalls {STALL_MS:g} ms, {n_req} requests",
        kvmux=kv,
        rival=mc,
        rival_name="vLLM MultiConnector (no deadline)",
        unit=(
            f"{n_req} requests arriving every {MEAN_INTERVAL_MS:g} ms on average; "
            f"kvmux: lookup_timeout_ms={DEADLINE_MS:g} on the stalling child, "
            "its breaker at the defaults"
        ),
        target=None,
        self_timed=True,
        figures=("p50", "p99"),
        repeats=10,
        warmup=1,
        check=check,
        notes=notes,
    )
