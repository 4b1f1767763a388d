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

import logging
from typing import TYPE_CHECKING, Any

from kvmux._core import SCHEDULER_HOOKS, SchedulerMux
from kvmux._versions import CacheHitSource
from kvmux.mux.children import Children
from kvmux.mux.config import MuxConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

__all__ = ["STATS_EVERY_S", "MuxScheduler", "own_source"]

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
        )
        #: Each child's own hit source (``_cache_hit_source``), by value.
        self.own_sources = [own_source(c) for c in children.connectors]
        #: The children asked to split their span, by the fan-out rule: not
        #: those whose split is vLLM's default, all of it under their own
        #: source, which the core applies itself (``own_sources``).
        active = set(children.active("get_external_cache_hit_sources"))
        self.splits = [i in active for i in range(len(children))]

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int] | None:
        """Each child that supplied tokens of the request's load splits its
        own span by source (its answer for the span; its own
        ``_cache_hit_source`` when it answers nothing or a wrong sum), and
        the splits are summed (the rule is the core's, ``rust/mux/sources.rs``).
        None when no child loads the request."""
        if CacheHitSource is None:  # pragma: no cover - a vLLM without the split never asks
            return None

        def split(i: int, span: int) -> list[tuple[str, int]] | None:
            if not self.splits[i]:
                return None
            got = self.children.call_one(i, "get_external_cache_hit_sources", request, span)
            return _pairs(got)

        pairs = self.mux.hit_sources(
            request.request_id, num_external_tokens, split, self.own_sources
        )
        if not pairs:
            return None
        return {_SOURCES[k]: n for k, n in pairs}

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


#: vLLM's hit sources by value. ``CacheHitSource`` is a ``str`` enum, so a
#: member finds itself here too: a split is read without an enum call per
#: pair (``CacheHitSource(k)`` costs ~0.5 us; this is once per load).
_SOURCES: dict[str, Any] = {} if CacheHitSource is None else {m.value: m for m in CacheHitSource}


def _pairs(split: Any) -> list[tuple[str, int]] | None:
    """A child's split as ``(source value, tokens)`` pairs; None when it is
    not a mapping of vLLM's sources to token counts."""
    if CacheHitSource is None or not hasattr(split, "items"):
        return None
    pairs = []
    try:
        for k, n in split.items():
            source = _SOURCES.get(k)
            if source is None:
                return None
            pairs.append((source.value, int(n)))
    except (TypeError, ValueError):
        return None
    return pairs if all(n >= 0 for _, n in pairs) else None
