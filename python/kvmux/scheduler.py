"""The scheduler side of :class:`~kvmux.connector.KvmuxConnector`.

:class:`MuxScheduler` owns the children (built for the scheduler role) and
the Rust multiplexer (:class:`kvmux._core.Mux`) that holds every live
request's state. The per-request hooks (lookup, allocation, finish, partial
tail) are methods of the Rust object itself: the connector binds them on
its instance, so vLLM's call goes straight into Rust, which calls the
children that matter. The per-step hooks that build Python objects for
vLLM (metadata, stats) are here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvmux._core import Mux
from kvmux._versions import CacheHitSource
from kvmux.children import Children
from kvmux.config import HMA_FIX, MuxConfig
from kvmux.metadata import KvmuxMetadata, KvmuxWorkerMetadata
from kvmux.stats import build_child_stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

__all__ = ["CORE_HOOKS", "STATS_EVERY_S", "MuxScheduler", "build_mux", "own_source"]

logger = logging.getLogger("kvmux")

#: kvmux's scheduler-side counters reach vLLM at most once per this many
#: seconds, and whenever no request is live (vLLM asks every step; the
#: counts wait in the core until taken, so none is lost, and a workload's
#: last ones are reported when it ends). vLLM logs every 5-10 s.
STATS_EVERY_S = 1.0

#: The hooks the Rust multiplexer runs: it calls these of the children, and
#: its methods of the same names are the scheduler-side connector's.
CORE_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "request_finished",
    "request_finished_all_groups",
    "register_finished_partial_tail",
    "on_new_request",
    "build_connector_meta",
    "update_connector_output",
    "get_kv_connector_stats",
)


def build_mux(cfg: MuxConfig, children: Children, block_size: int, *, hooks: bool) -> Mux:
    """The Rust multiplexer over ``children``; with ``hooks``, it calls the
    children's per-request hooks (scheduler side); without, it only keeps
    the counters (worker side)."""
    return Mux(
        list(children.names),
        cfg.clash_policy,
        cfg.load_policy,
        block_size,
        {h: children.core_plan(h) for h in CORE_HOOKS} if hooks else {},
        [spec.supports_hma for spec in cfg.children],
        logger,
        HMA_FIX,
        {
            "metadata": KvmuxMetadata,
            "worker_metadata": KvmuxWorkerMetadata,
            "stats": build_child_stats,
            "stats_every_s": STATS_EVERY_S,
        }
        if hooks
        else None,
        [spec.lookup_timeout_ms for spec in cfg.children],
        [
            None if b is None else (b.failures, b.cooldown_ms, b.max_cooldown_ms)
            for b in (spec.breaker for spec in cfg.children)
        ],
        [spec.load_timeout_ms for spec in cfg.children],
    )


class MuxScheduler:
    """kvmux's scheduler-side state: the Rust multiplexer and the children."""

    def __init__(self, cfg: MuxConfig, children: Children, vllm_config: VllmConfig) -> None:
        self.children = children
        self.mux = build_mux(cfg, children, vllm_config.cache_config.block_size, hooks=True)
        #: Each child's own hit source (``_cache_hit_source``), by value.
        self.own_sources = [own_source(c) for c in children.connectors]

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
            got = self.children.call_one(i, "get_external_cache_hit_sources", request, span)
            return _pairs(got)

        pairs = self.mux.hit_sources(
            request.request_id, num_external_tokens, split, self.own_sources
        )
        if not pairs:
            return None
        return {CacheHitSource(k): n for k, n in pairs}

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


def _pairs(split: Any) -> list[tuple[str, int]] | None:
    """A child's split as ``(source value, tokens)`` pairs; None when it is
    not a mapping of vLLM's sources to token counts."""
    if CacheHitSource is None or not hasattr(split, "items"):
        return None
    try:
        pairs = [(CacheHitSource(k).value, int(n)) for k, n in split.items()]
    except (TypeError, ValueError):
        return None
    return pairs if all(n >= 0 for _, n in pairs) else None
