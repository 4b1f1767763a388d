"""``KvmuxConnector``: run several vLLM KV connectors as one.

The connector is a facade, as vLLM's own ``OffloadingConnector`` is: it
builds the children for its role and then either the scheduler side
(:class:`kvmux.mux.scheduler.MuxScheduler`, over the Rust multiplexer that holds
every live request's state) or the worker side
(:class:`kvmux.mux.worker.MuxWorker`). Every hook of vLLM's connector interface
is declared below with its contract, in the order of vLLM's
``multi_connector.py``. The scheduler hooks the Rust multiplexer runs
(``kvmux._core.SCHEDULER_HOOKS``) are its methods: declared here as
:class:`~kvmux.mux._hooks.SchedulerHook` (vLLM's call goes straight into Rust),
or, where vLLM wants a Python object back (metadata, stats), a method that
builds it from the Rust answer. The per-layer hooks are
:class:`~kvmux.mux._hooks.LayerHook`: the one child that does something.

What kvmux adds over vLLM's ``MultiConnector`` (same ``connectors`` schema):

- ``clash_policy`` (``error`` | ``strict`` | ``first`` | ``last``) for
  ``kv_transfer_params`` returned by several children, errors naming the key
  and both children;
- ``load_policy`` (``first`` | ``longest``) choosing the loading child;
- ``num_extra_cached_tokens`` in a finished request's params when its
  ``kv_transfer_params`` ask for it;
- every child asked on a lookup and a stale load choice never outlives a
  re-lookup;
- configuration checked with :class:`KvmuxConfigError` (not ``assert``),
  HMA refused at construction naming the children that lack it, and a
  multi-group finish without HMA raising instead of truncating;
- a child failing in a scheduler or worker hook raises
  :class:`KvmuxChildError` naming it (per-layer hooks excepted, see
  ``save_kv_layer``), and a failure on a request the child never took part
  in is contained (``SchedulerMux::finish`` in ``rust/mux/scheduler/finish.rs``);
- children whose hook only returns a constant are not called at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvmux import _versions
from kvmux.errors import KvmuxConfigError
from kvmux.mux._hooks import (
    AnyChildHook,
    LayerHook,
    QuietHook,
    SchedulerHook,
    StatsHook,
)
from kvmux.mux.children import Children
from kvmux.mux.config import MuxConfig, check_hma, parse_mux_config
from kvmux.mux.events import KvmuxKVEvents
from kvmux.mux.metadata import KvmuxWorkerMetadata
from kvmux.mux.parent_name import parent_name_problems
from kvmux.mux.scheduler import MuxScheduler
from kvmux.mux.stats import KvmuxStats
from kvmux.mux.worker import MuxWorker
from kvmux.roles import WrongRole, wrong_role

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvmuxConnector"]


def _parse_from_vllm_config(vllm_config: VllmConfig) -> MuxConfig:
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise KvmuxConfigError("vllm_config.kv_transfer_config is not set")
    return parse_mux_config(ktc)


def _children_or_none(ktc: KVTransferConfig) -> tuple[Any, ...]:
    """The children of ``ktc`` for the classmethods vLLM 0.34 asks while it
    builds its ``VllmConfig``; none for a config kvmux cannot run, which the
    connector then refuses at construction with :class:`KvmuxConfigError`
    naming every problem (raised from here, vLLM would wrap it in its own
    config validation error)."""
    try:
        return parse_mux_config(ktc).children
    except KvmuxConfigError:
        return ()


class KvmuxConnector(KVConnectorBase_V1, SupportsHMA):
    """A KV connector that runs the children listed in
    ``kv_connector_extra_config["connectors"]`` as one.

    Loaded by vLLM through ``{"kv_connector": "KvmuxConnector",
    "kv_connector_module_path": "kvmux"}``. The same class is exported as
    ``kvmux.MultiConnector`` so that ``{"kv_connector": "MultiConnector",
    "kv_connector_module_path": "kvmux"}`` gets vLLM's child-aware HMA
    auto-detection (see the README).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        # vLLM (>= 0.32) always passes one and types it so; kvmux passes on None too.
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        cfg = parse_mux_config(self._kv_transfer_config)
        named = parent_name_problems(self._kv_transfer_config, cfg, vllm_config)
        if named:
            raise KvmuxConfigError(named)
        check_hma(
            cfg,
            not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
            kv_cache_config,
        )
        self._children = Children(cfg, vllm_config, role, kv_cache_config)
        self._scheduler: MuxScheduler | None = None
        self._worker: MuxWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = MuxScheduler(cfg, self._children, vllm_config)
            #: The Rust multiplexer whose methods are the scheduler hooks.
            self._scheduler_mux: Any = self._scheduler.mux
        else:
            self._worker = MuxWorker(cfg, self._children)
            self._scheduler_mux = WrongRole("scheduler")

    def _sched(self, hook: str) -> MuxScheduler:
        if self._scheduler is None:
            raise wrong_role(hook, "scheduler")
        return self._scheduler

    def _work(self, hook: str) -> MuxWorker:
        if self._worker is None:
            raise wrong_role(hook, "worker")
        return self._worker

    # ------------------------------------------------------------------ info

    @property
    def children(self) -> list[KVConnectorBase_V1]:
        """The child connectors, in config order."""
        return list(self._children.connectors)

    @property
    def child_names(self) -> list[str]:
        return list(self._children.names)

    sub_connectors = children

    def active_children(self, hook: str) -> tuple[int, ...]:
        """Indices of the children kvmux calls for ``hook``: those whose hook
        does something (a hook that only returns a constant is not called)."""
        return self._children.active(hook)

    def num_live_requests(self) -> int:
        """Requests the scheduler side still holds state for (0 once every
        request has finished; 0 on a worker)."""
        return len(self._scheduler.mux) if self._scheduler is not None else 0

    def num_pending_async_saves(self) -> int:
        """Worker side: finished requests still waiting for async-save
        completions from some of their children (0 on the scheduler)."""
        return self._worker.mux.pending_sends() if self._worker is not None else 0

    def num_pending_async_loads(self) -> int:
        """Worker side: requests still waiting for an async load's completion
        from a child that loads them (0 on the scheduler)."""
        return self._worker.mux.pending_recvs() if self._worker is not None else 0

    def mux_stats(self) -> dict[str, Any]:
        """kvmux's own counters on this side: per child lookups, hits, loads,
        timeouts, breaker openings, completions...; finished requests, extra
        cached tokens, clashes, live requests, pending async saves; and
        ``breakers``: each child's breaker state (``"closed"``, ``"open"``,
        ``"half_open"``); ``load_decision`` (scheduler side, when it
        measures): what the load decision has learned, the engine's
        ``compute_s_per_token`` and per child ``load_s``,
        ``load_s_per_token`` and ``not_ready_wait_s``."""
        side = self._scheduler or self._worker
        if side is None:  # pragma: no cover - one side is always built
            raise RuntimeError("kvmux connector has no side")
        out = side.mux.stats()
        out["pending_async_saves"] = self.num_pending_async_saves()
        return out

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        kids = self._children.connectors
        return bool(kids) and all(c.supports_divergent_local_hybrid_hits for c in kids)

    @property
    def requires_kv_delivery(self) -> bool:
        return any(c.requires_kv_delivery for c in self._children.connectors)

    # ===================================================== class methods

    @classmethod
    def all_children_support_hma(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """True only if every configured child supports the hybrid KV cache
        manager: the answer of vLLM's ``MultiConnector.all_children_support_hma``
        for the same config, so code that asks the class gets one. Raises
        :class:`KvmuxConfigError` for a config kvmux cannot run."""
        return parse_mux_config(kv_transfer_config).all_support_hma

    @classmethod
    def validate_transfer_config(cls, kv_transfer_config: KVTransferConfig) -> None:
        """Raise :class:`KvmuxConfigError` if kvmux cannot run this config
        (used for nested kvmux children and by ``python -m kvmux doctor``)."""
        parse_mux_config(kv_transfer_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        cfg = _parse_from_vllm_config(vllm_config)
        layouts = {
            spec.name: layout
            for spec in cfg.children
            if (layout := spec.cls.get_required_kvcache_layout(spec.vllm_config_for(vllm_config)))
            is not None
        }
        if len(set(layouts.values())) > 1:
            raise KvmuxConfigError(
                f"children need different KV cache layouts {layouts}; all children "
                "must agree on one layout (drop one of them or configure them alike)"
            )
        return next(iter(layouts.values()), None)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        from vllm.config.kv_transfer import KVTransferConfig

        cfg = parse_mux_config(
            KVTransferConfig(
                kv_connector=cls.__name__, kv_role="kv_both", kv_connector_extra_config=extra_config
            )
        )
        return any(
            spec.cls.requires_piecewise_for_cudagraph(
                spec.transfer_config.kv_connector_extra_config
            )
            for spec in cfg.children
        )

    if _versions.HAS_SLEEP_MODE:

        @classmethod
        def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
            cfg = parse_mux_config(kv_transfer_config)
            return all(spec.cls.supports_sleep_mode(spec.transfer_config) for spec in cfg.children)

    if _versions.HAS_KV_CACHE_ACCESS:

        @classmethod
        def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> Any:
            """How the children's workers reach the device KV cache: the union
            of every child's ``KVCacheAccess`` flags, each asked through vLLM's
            factory (so its fallback for an LMCache class that predates the
            hook applies) with the child's config exactly as kvmux builds it
            at run time (the role, engine id and ``kv_buffer_device`` it
            inherits included). vLLM 0.34 decides from it how to allocate the
            KV cache, or whether its extensible KV cache can be used.
            ``IN_PROCESS`` for a config kvmux cannot run (refused at
            construction)."""
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            access = _versions.KVCacheAccess.IN_PROCESS
            for spec in _children_or_none(kv_transfer_config):
                # vLLM 0.34's classmethod: unknown to mypy over an older vLLM.
                access |= KVConnectorFactory.kv_cache_access(spec.transfer_config)  # type: ignore[attr-defined, unused-ignore]
            return access

    if _versions.HAS_LOOKAHEAD_HASHES:

        @classmethod
        def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig) -> bool:
            """True only when every child's is: vLLM 0.34 hashes each block
            together with the tokens after it (a drafter's lookahead) only
            if the connector says it can key its blocks that way."""
            children = _children_or_none(kv_transfer_config)
            return bool(children) and all(
                spec.cls.supports_lookahead_block_hashes(spec.transfer_config) for spec in children
            )

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvmuxStats.rebuild(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from kvmux.mux.stats import KvmuxPromMetrics

        cfg = _parse_from_vllm_config(vllm_config)
        return KvmuxPromMetrics.build(
            cfg, vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # ======================================================= worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Every child gets the KV cache tensors."""
        self._children.each("register_kv_caches", kv_caches)

    def unregister_kv_caches(self) -> None:
        self._children.each("unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        self._children.each("restore_kv_caches")

    def set_host_xfer_buffer_ops(self, copy_operation: Callable[..., None]) -> None:
        self._children.each("set_host_xfer_buffer_ops", copy_operation)

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        """The one child's KV cache memory pool; two children with one are
        an error (the KV cache lives in one pool)."""
        return self._children.mem_pool_context()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Each child gets its own metadata; kvmux's part (extra async
        saves, dropped completions) goes to the worker side."""
        self._work("bind_connector_metadata").bind_connector_metadata(connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._children.each("clear_connector_metadata")
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._work("handle_preemptions").handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Every child starts its loads for the step."""
        self._children.each("start_load_kv", forward_context, **kwargs)

    wait_for_layer_load = LayerHook(
        """Every child whose hook does something waits for ``layer_name``'s
        load: ``wait_for_layer_load(layer_name)``."""
    )

    save_kv_layer = LayerHook(
        """Every child whose hook does something gets ``layer_name``'s KV to
        save: ``save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)``."""
    )

    def wait_for_save(self) -> None:
        self._children.each("wait_for_save")

    def finish_forward(self) -> None:
        self._children.each("finish_forward")

    def reset_capture_state(self) -> None:
        self._children.each("reset_capture_state")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """A request is finished sending once every child that saved it
        asynchronously has reported it."""
        return self._work("get_finished").get_finished(finished_req_ids)

    if _versions.HAS_TRANSFER_RESULTS:

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            """As ``get_finished``, with failed receives passed through."""
            return self._work("get_transfer_results").get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Every child's failed blocks (vLLM recomputes or fails them)."""
        return self._work("get_block_ids_with_load_errors").get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KvmuxWorkerMetadata | None:
        """Each child's worker metadata, in config order; None if none has any."""
        return self._work("build_connector_worker_meta").build_connector_worker_meta()

    def get_handshake_metadata(self) -> Any:
        """The first child's handshake metadata (NIXL's, for a P/D pair)."""
        return self._children.first_not_none("get_handshake_metadata")

    def get_finished_count(self) -> int | None:
        """The children's common count of workers reporting a finish."""
        return self._children.agree("get_finished_count")

    def get_kv_connector_kv_cache_events(self) -> KvmuxKVEvents | None:
        """Each child's KV events container of the step, kept apart: vLLM
        merges them across workers child by child, and each child's
        ``update_connector_output`` gets its own (see ``kvmux.mux.events``).
        None when no child has any."""
        return self._children.worker_events()

    get_kv_connector_stats = StatsHook(
        """``() -> KvmuxStats | None``: stats of the last interval: kvmux's
        own counters and each child's, by child name (on either side; the
        scheduler's counters at most once a second and when idle, see
        ``kvmux.mux.scheduler.STATS_EVERY_S``)."""
    )

    def shutdown(self) -> None:
        """Every child is shut down, even when one fails (the first error
        is raised after)."""
        self._children.call_all("shutdown")

    # ===================================================== scheduler side

    get_num_new_matched_tokens = SchedulerHook(
        """``(request, num_computed_tokens) -> (int | None, bool)``: ask every
        child; ``None`` while any child is not ready. The loading child is
        chosen by ``load_policy`` and remembered for the request."""
    )

    update_state_after_alloc = SchedulerHook(
        """``(request, blocks, num_external_tokens)``: the chosen child gets
        ``num_external_tokens``, the others 0; all get the request's real
        blocks (as vLLM's MultiConnector does)."""
    )

    get_external_cache_hit_sources = SchedulerHook(
        """``(request, num_external_tokens)``: each loading child's own split
        of the span it supplied, summed (``rust/mux/sources.rs``); a child
        keeping vLLM's default split is not called. vLLM's default when none
        loads."""
    )

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The loading child's answer (vLLM's default when none loads)."""
        got = self._sched("get_loaded_kv_cache_group_ids").get_loaded_kv_cache_group_ids(request)
        if got is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return got

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._sched("bind_kv_cache_manager").bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._children.each("bind_gpu_block_pool", gpu_block_pool)

    may_load_async = AnyChildHook(
        """``(request) -> bool``: true when any child may load ``request``
        asynchronously (vLLM 0.34 then queues it where its load can start
        while the running batch is full). Runs on every enqueue: a child
        whose answer is a constant is not asked (``KvmuxHostCache`` loads
        synchronously and answers False), a single child that answers per
        request is its bound method, with no kvmux frame."""
    )

    on_new_request = SchedulerHook(
        """``(request)``: every child whose hook does something hears of the
        request."""
    )

    build_connector_meta = SchedulerHook(
        """``(scheduler_output) -> KvmuxMetadata``: each child's metadata,
        plus what the workers must know of the requests since the last step
        (async saves and loads, the blocks of loads with a deadline)."""
    )

    update_connector_output = SchedulerHook(
        """``(connector_output)``: each child sees its own slice of the
        workers' metadata. Loads the workers report failed
        (``invalid_block_ids``, ``failed_recving``) stop counting in
        ``num_extra_cached_tokens``; vLLM handles the requests."""
    )

    request_finished = SchedulerHook(
        """``(request, block_ids) -> (bool, dict | None)``: every child's
        ``request_finished``; async if any child saves asynchronously, params
        merged under ``clash_policy``; a failure of a child that never took
        part in the request is contained."""
    )

    request_finished_all_groups = SchedulerHook(
        """``(request, block_ids: tuple[list[int], ...]) -> (bool, dict |
        None)``: vLLM's finish for an HMA connector (kvmux is one), with the
        request's blocks per KV cache group. A child with HMA support gets
        every group (``request_finished_all_groups``); a child without gets
        ``request_finished`` with the one group's blocks, which are all of
        the request's blocks. Several groups with such a child raise
        :class:`KvmuxConfigError` naming them (never silently truncated; the
        constructor already refuses that model unless HMA is off)."""
    )

    register_finished_partial_tail = SchedulerHook(
        """``(request, block_ids, partial_tail_offloads) -> bool``: true when
        any child keeps the request's blocks for a partial tail. Called on a
        request's way out, so a child that never took part in the request and
        fails is contained."""
    )

    take_events = QuietHook(
        """``() -> Iterable[KVCacheEvent]``: every child's KV cache events, in
        config order, each labelled with the child it came from
        (``ownership``: the child's name, or ``name/ownership`` when the
        child set one), identical repeats with nothing between them that
        changed their blocks dropped (see ``kvmux.mux.events``). vLLM publishes
        them with its own GPU events. ``()`` when no child has events.""",
        tuple,
        "_take_events",
    )

    def _take_events(self) -> Iterable[Any]:
        return self._children.take_events()

    has_pending_block_frees = QuietHook(
        """``() -> bool``: true when any child still holds blocks to free.""",
        bool,
        "_has_pending_block_frees",
    )

    def _has_pending_block_frees(self) -> bool:
        return self._children.any("has_pending_block_frees")

    has_pending_push_work = QuietHook(
        """``() -> bool``: true when any child has KV still to push.""",
        bool,
        "_has_pending_push_work",
    )

    def _has_pending_push_work(self) -> bool:
        return self._children.any("has_pending_push_work")

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._children.each("set_xfer_handshake_metadata", metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self._children.each("set_xfer_handshake_metadata_pp_aware", metadata)

    def reset_cache(self) -> bool:
        """True unless a child reports its reset failed (``False``)."""
        return self._children.all_not_false("reset_cache")
