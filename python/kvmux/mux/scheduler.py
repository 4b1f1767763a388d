"""The scheduler side of :class:`~kvmux.mux.connector.KvmuxConnector`.

:class:`MuxScheduler` owns the children (built for the scheduler role) and
the Rust multiplexer (:class:`kvmux._core.SchedulerMux`) that holds every
live request's state. vLLM's scheduler hooks named in
``kvmux._core.SCHEDULER_HOOKS`` are the Rust object's own methods: the
connector resolves them there (:class:`kvmux.mux._hooks.SchedulerHook`), so
vLLM's call goes straight into Rust, which calls the children that matter.
The hooks the Rust core does not run (hit sources, loaded groups) are here.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from kvmux._core import SCHEDULER_HOOKS, SchedulerMux
from kvmux._versions import CacheHitSource
from kvmux.mux.children import Children
from kvmux.mux.config import MuxConfig
from kvmux.mux.stats import KvmuxStats
from kvmux.mux.timeline import TimelineFile

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

__all__ = ["STATS_EVERY_S", "MuxScheduler", "own_source", "without_requests"]

logger = logging.getLogger("kvmux")

#: kvmux's scheduler-side counters reach vLLM at most once per this many
#: seconds, and whenever no request is live (vLLM asks every step; the
#: counts wait in the core until taken, so none is lost, and a workload's
#: last ones are reported when it ends). vLLM logs every 5-10 s.
STATS_EVERY_S = 1.0


class MuxScheduler:
    """kvmux's scheduler-side state: the Rust multiplexer and the children."""

    def __init__(self, cfg: MuxConfig, children: Children, vllm_config: VllmConfig) -> None:
        self.children = children
        self.mux = SchedulerMux(
            [
                (
                    spec.name,
                    spec.supports_hma,
                    spec.lookup_timeout_ms,
                    spec.load_timeout_ms,
                    None
                    if spec.breaker is None
                    else (
                        spec.breaker.failures,
                        spec.breaker.cooldown_ms,
                        spec.breaker.max_cooldown_ms,
                    ),
                )
                for spec in cfg.children
            ],
            cfg.clash_policy,
            cfg.load_policy,
            vllm_config.cache_config.block_size,
            {hook: children.facts(hook) for hook in SCHEDULER_HOOKS},
            logger,
            STATS_EVERY_S,
            hit_sources(children.connectors),
            KvmuxStats,
            cfg.load_decision,
            None if cfg.timeline_path is None else TimelineFile(cfg.timeline_path).write,
            [spec.save_policy for spec in cfg.children],
            without_requests,
            None,
            [spec.transport for spec in cfg.children],
        )

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...] | None:
        """The chosen child's answer; None when no child loads the request."""
        chosen = self.mux.chosen(request.request_id)
        if chosen is None:
            return None
        return self.children.call_one(chosen, "get_loaded_kv_cache_group_ids", request)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self.children.each("bind_kv_cache_manager", kv_cache_manager)


def own_source(connector: Any) -> str:
    """The hit source a connector declares (``_cache_hit_source``), by
    value (``"host"``, ``"p2p"``, ...); ``"external_unspecified"`` for one
    that declares none or something vLLM does not know (and on a vLLM without the split)."""
    if CacheHitSource is None:
        return "external_unspecified"
    try:
        return CacheHitSource(getattr(connector, "_cache_hit_source", None)).value
    except ValueError:
        return CacheHitSource.EXTERNAL_UNSPECIFIED.value


def hit_sources(connectors: list[Any]) -> tuple[dict[str, Any], list[str], Any] | None:
    """What the core needs to answer vLLM's ``get_external_cache_hit_sources``
    itself (``PySchedulerMux.get_external_cache_hit_sources``): vLLM's
    sources by value (``CacheHitSource`` is a ``str`` enum, so a child's
    member finds itself there too, with no enum call per pair), each child's
    own source, and the multiplexer's own (vLLM's default answer when no
    child loads). None on a vLLM without the split (it never asks)."""
    if CacheHitSource is None:
        return None
    by_value = {m.value: m for m in CacheHitSource}
    return by_value, [own_source(c) for c in connectors], CacheHitSource.EXTERNAL_UNSPECIFIED


def without_requests(scheduler_output: Any, hidden: set[str]) -> Any:
    """vLLM's ``SchedulerOutput`` without the requests in ``hidden``: what a
    child whose save of them kvmux declined gets in ``build_connector_meta``
    (save admission, ``rust/mux/scheduler/saves.rs``), so it plans no save
    of them. A shallow copy: the original, which vLLM and the other children
    use, is not touched. The scheduled requests (new and cached, with their
    per-request lists), their scheduled tokens and spec-decode tokens leave;
    ``finished_req_ids`` and ``preempted_req_ids`` stay (a child frees what it
    holds of them)."""
    view = copy.copy(scheduler_output)
    view.scheduled_new_reqs = [
        r for r in scheduler_output.scheduled_new_reqs if r.req_id not in hidden
    ]
    cached = scheduler_output.scheduled_cached_reqs
    ids = list(cached.req_ids)
    keep = [j for j, r in enumerate(ids) if r not in hidden]
    if len(keep) != len(ids):
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(cached):
            value = getattr(cached, f.name)
            if isinstance(value, list) and len(value) == len(ids):
                changes[f.name] = [value[j] for j in keep]
            elif isinstance(value, set | frozenset):
                changes[f.name] = type(value)(v for v in value if v not in hidden)
            elif isinstance(value, dict):
                changes[f.name] = {k: v for k, v in value.items() if k not in hidden}
        view.scheduled_cached_reqs = dataclasses.replace(cached, **changes)
    sched = {k: v for k, v in scheduler_output.num_scheduled_tokens.items() if k not in hidden}
    view.num_scheduled_tokens = sched
    view.total_num_scheduled_tokens = sum(sched.values())
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
    if isinstance(spec, dict):
        view.scheduled_spec_decode_tokens = {k: v for k, v in spec.items() if k not in hidden}
    return view
