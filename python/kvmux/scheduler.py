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
from kvmux.children import Children
from kvmux.config import HMA_FIX, MuxConfig
from kvmux.metadata import KvmuxMetadata, KvmuxWorkerMetadata
from kvmux.stats import KvmuxStats, build_child_stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["CORE_HOOKS", "STATS_EVERY_S", "MuxScheduler", "build_mux"]

logger = logging.getLogger("kvmux")

#: kvmux's scheduler-side counters reach vLLM at most once per this many
#: seconds, and whenever no request is live (vLLM asks every step; the
#: counts wait in the core until taken, so none is lost, and a workload's
#: last ones are reported when it ends). vLLM logs every 5-10 s.
STATS_EVERY_S = 1.0

#: The children's hooks the Rust multiplexer calls itself.
CORE_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "request_finished",
    "request_finished_all_groups",
    "register_finished_partial_tail",
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
    )


class MuxScheduler:
    """kvmux's scheduler-side state: the Rust multiplexer and the children."""

    def __init__(self, cfg: MuxConfig, children: Children, vllm_config: VllmConfig) -> None:
        self.children = children
        self.mux = build_mux(cfg, children, vllm_config.cache_config.block_size, hooks=True)
        self.kv_cache_manager: KVCacheManager | None = None
        # No child has stats of its own: the common quiet step is one call.
        self._child_stats = not children.silent("get_kv_connector_stats")

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int] | None:
        """The chosen child's answer; None when no child loads the request."""
        chosen = self.mux.chosen(request.request_id)
        if chosen is None:
            return None
        return self.children.call_one(
            chosen, "get_external_cache_hit_sources", request, num_external_tokens
        )

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...] | None:
        """The chosen child's answer; None when no child loads the request."""
        chosen = self.mux.chosen(request.request_id)
        if chosen is None:
            return None
        return self.children.call_one(chosen, "get_loaded_kv_cache_group_ids", request)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.children.each("bind_kv_cache_manager", kv_cache_manager)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvmuxMetadata:
        """Every child's metadata, and what the workers must know of the
        requests that finished since the last step."""
        extra, dropped = self.mux.take_outbox()
        return KvmuxMetadata(
            children=tuple(self.children.call("build_connector_meta", scheduler_output)),
            extra_async_saves=extra,
            dropped_saves=dropped,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Loads the workers report failed stop counting in
        ``num_extra_cached_tokens``; each child sees its own slice of the
        workers' metadata."""
        if self.mux.watching:  # some load is planned: did any fail?
            self.mux.load_errors(
                connector_output.invalid_block_ids,
                getattr(connector_output, "failed_recving", None),
            )
        worker_meta = connector_output.kv_connector_worker_meta
        if worker_meta is not None and not isinstance(worker_meta, KvmuxWorkerMetadata):
            raise TypeError(
                f"kvmux got worker metadata of type {type(worker_meta).__name__}; "
                "the workers must run the same KvmuxConnector configuration"
            )
        active = self.children.active("update_connector_output")
        if not active:
            return
        try:
            for i in active:
                if worker_meta is not None:
                    connector_output.kv_connector_worker_meta = worker_meta.children[i]
                self.children.call_one(i, "update_connector_output", connector_output)
        finally:
            connector_output.kv_connector_worker_meta = worker_meta

    def get_kv_connector_stats(self) -> KvmuxStats | None:
        """kvmux's counters of the interval (see :data:`STATS_EVERY_S`) and
        each child's stats."""
        if not self._child_stats:
            counters = self.mux.take_interval(STATS_EVERY_S)
            if counters is None:
                return None
            return build_child_stats(self.children.names, (None,) * len(self.children), counters)
        return build_child_stats(
            self.children.names,
            self.children.call("get_kv_connector_stats"),
            self.mux.take_interval(STATS_EVERY_S),
        )
