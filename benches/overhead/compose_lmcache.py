"""C1L: C1 (:mod:`benches.overhead.compose`) with the real LMCache as the second
tier, so the time to load compares a local span with a remote one.

Same workload, policies and checks as C1; ``tier2`` is LMCache's
``LMCacheMPConnector`` (the README's child entry, the load-failure policy
``recompute`` the README recommends with it) talking to a real LMCache MP
server that this case starts on loopback (:mod:`kvmux.bench.lmcache`) and
that is stopped when the bench exits. Under ``compose`` the host tier loads
``[0, a)`` from host memory and LMCache only ``[a, b)``; under ``longest``
LMCache loads all of ``[0, b)``; under ``first`` the host tier loads
``[0, a)`` and ``[a, b)`` is recomputed.

LMCache reports its loads as asynchronous (the request waits in
``WAITING_FOR_REMOTE_KVS``; the worker's ``get_transfer_results``, or
``get_finished`` before vLLM 0.33, reports each one done). On a GPU,
``start_load_kv`` only submits them; on a CPU-only machine LMCache's worker
uses its synchronous ``EngineDrivenTransferContext``, so ``start_load_kv``
returns once every span is in the paged KV (per request: a round trip to
the server to stage the chunks, the copy, a round trip to release them)
and the same step reports them done. The time to load is C1's clock
(:class:`benches.overhead.compose.LoadClock`), which covers both: the seconds
during which the worker is in a load hook or has an asynchronous load
outstanding, from the ``start_load_kv`` that submits a load to the poll
that reports the last one done, the engine loop's steps and its idle polls
(every :data:`IDLE_WAIT_S`) in between included. LMCache's lookups before
that (also asynchronous) are not counted. The connector has no byte
counter: LMCache's bytes are the tokens kvmux credits it with
(``load_tokens``; per request ``cached_tokens_by_child``) times the KV
bytes per token. Each run uses a model folder of its own, so its LMCache
keys are new: no run finds an earlier run's KV.

If LMCache is not installed, :mod:`benches.overhead` does not list C1L (the
runner has no way to skip a case), and ``build`` raises with the reason.
"""

from __future__ import annotations

import contextlib
import os

from benches.overhead import compose
from benches.overhead.case import Case
from kvmux.bench.lmcache import LMCacheServer, unavailable

__all__ = ["IDLE_WAIT_S", "build"]

IDLE_WAIT_S = 0.001
"""The engine loop's wait after a step that scheduled nothing (polling
LMCache's lookups and loads)."""


def build(quick: bool) -> Case:
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"C1L needs the LMCache server: {why}")
    # LMCache's connector, imported in this process, prints a banner and logs
    # each registration at INFO, in the bench's output.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    server = LMCacheServer().start()  # stopped at exit (the runner has no tear-down)
    try:
        tier2 = compose.Tier2(
            key="C1L",
            label="LMCache",
            connector="LMCacheMPConnector",
            entry=lambda room: server.child("tier2"),
            failure_policy="recompute",
            idle_wait_s=IDLE_WAIT_S,
            shared=True,
            host_cache=False,
            notes={
                "lmcache_server": " ".join(server.command()[1:]),
                "idle_wait_s": IDLE_WAIT_S,
            },
        )
        return compose.build(quick, tier2)
    except BaseException:
        with contextlib.suppress(Exception):
            server.stop()
        raise
