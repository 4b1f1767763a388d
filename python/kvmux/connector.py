"""``KvmuxConnector``: run several vLLM KV connectors as one.

The scheduler-side bookkeeping (which child loads a request, the tokens it
supplied, the clash-checked merge of params, async-save counts) lives in the
Rust core (:class:`kvmux._core.MuxCore`), one call per connector event. This
class owns every vLLM call: it asks the children, hands their answers to the
core, and routes the core's decisions back to them.

What kvmux adds over vLLM's ``MultiConnector`` (same ``connectors`` schema):

- ``clash_policy`` (``error`` | ``strict`` | ``first`` | ``last``) for
  ``kv_transfer_params`` returned by several children, errors naming the key
  and both children;
- ``load_policy`` (``first`` | ``longest``) choosing the loading child;
- ``num_extra_cached_tokens`` in a finished request's params when its
  ``kv_transfer_params`` ask for it;
- every child asked on a lookup (their async lookups overlap) and a stale
  load choice never outlives a re-lookup;
- configuration checked with :class:`KvmuxConfigError` (not ``assert``),
  HMA refused at construction naming the children that lack it, and a
  multi-group finish without HMA raising instead of truncating;
- per-layer hooks that call only children whose hook does something.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvmux import _versions
from kvmux._containment import DroppedSaves, call_children_on_exit, call_each_on_exit
from kvmux._core import MuxCore, SaveCountdown
from kvmux._fanout import (
    active_children,
    call_child,
    call_children,
    install_fanout,
    layer_hook,
)
from kvmux._load_failures import LoadWatch
from kvmux.config import HMA_FIX, MuxConfig, check_hma, parse_mux_config
from kvmux.errors import KvmuxChildError, KvmuxConfigError
from kvmux.metadata import KvmuxMetadata, KvmuxWorkerMetadata
from kvmux.stats import KvmuxStats, build_child_stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvmux")

EXTRA_KEY = "num_extra_cached_tokens"

__all__ = ["KvmuxConnector"]


def _parse_from_vllm_config(vllm_config: VllmConfig) -> MuxConfig:
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise KvmuxConfigError("vllm_config.kv_transfer_config is not set")
    return parse_mux_config(ktc)


@install_fanout(KVConnectorBase_V1)
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
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = parse_mux_config(self._kv_transfer_config)
        check_hma(
            cfg,
            not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
            kv_cache_config,
        )
        self._cfg = cfg
        # How request_finished_all_groups reaches the children (decided once).
        self._all_hma = cfg.all_support_hma
        self._any_hma = any(spec.supports_hma for spec in cfg.children)
        self._names: tuple[str, ...] = tuple(cfg.names)
        self._children: list[KVConnectorBase_V1] = []
        try:
            for spec in cfg.children:
                try:
                    child = spec.cls(spec.vllm_config_for(vllm_config), role, kv_cache_config)
                except Exception as e:
                    raise KvmuxChildError(spec.name, "__init__", f"{type(e).__name__}: {e}") from e
                self._children.append(child)
        except BaseException:
            self._shutdown_built()
            raise
        self._core = MuxCore(list(self._names), cfg.clash_policy, cfg.load_policy)
        # Scheduler side: extra async completions to send with the next metadata.
        self._extra_saves: dict[str, int] = {}
        # Scheduler side: blocks of planned loads, to map load errors back.
        self._loads = LoadWatch(vllm_config.cache_config.block_size)
        self._load_blocks = self._loads.blocks
        # Failures contained on requests a child never took part in (see
        # kvmux._containment): children warned about, and the children whose
        # completions of a request the workers drop (sent with the metadata).
        self._contained_warned: set[int] = set()
        self._dropped_saves: dict[str, tuple[int, ...]] = {}
        self._dropped = DroppedSaves()
        # Worker side: the countdown of those completions.
        self._countdown = SaveCountdown()
        # Per-layer hot path: only children whose hook does something.
        self.wait_for_layer_load: Callable[[str], None] = layer_hook(
            self._children, "wait_for_layer_load"
        )
        self.save_kv_layer: Callable[..., None] = layer_hook(self._children, "save_kv_layer")

    def _shutdown_built(self) -> None:
        for child in self._children:
            try:
                child.shutdown()
            except Exception:
                logger.exception("kvmux: shutting down a child after a failed start failed")
        self._children.clear()

    # ------------------------------------------------------------------ info

    @property
    def children(self) -> list[KVConnectorBase_V1]:
        """The child connectors, in config order."""
        return list(self._children)

    @property
    def child_names(self) -> list[str]:
        return list(self._names)

    sub_connectors = children

    def num_live_requests(self) -> int:
        """Requests the scheduler-side table still holds (0 once every request
        has finished)."""
        return len(self._core)

    def num_pending_async_saves(self) -> int:
        """Worker side: finished requests still waiting for async-save
        completions from some of their children."""
        return len(self._countdown)

    def mux_stats(self) -> dict[str, Any]:
        """kvmux's own counters: per child lookups, hits, loads; finished
        requests, extra cached tokens, clashes, live requests."""
        out = self._core.stats()
        out["pending_async_saves"] = len(self._countdown)
        return out

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(self._children) and all(
            c.supports_divergent_local_hybrid_hits for c in self._children
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return any(c.requires_kv_delivery for c in self._children)

    # ------------------------------------------------------- class methods

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
        from kvmux.stats import KvmuxPromMetrics

        cfg = _parse_from_vllm_config(vllm_config)
        return KvmuxPromMetrics.build(
            cfg, vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # ------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Ask every child; ``None`` while any child is not ready. The loading
        child is chosen by ``load_policy`` and remembered for the request."""
        try:
            answers = call_children(
                self, "get_num_new_matched_tokens", request, num_computed_tokens
            )
            return self._core.lookup(request.request_id, num_computed_tokens, answers)
        except BaseException:
            # A child failed on the request: kvmux drops its own state for it
            # (a later lookup starts afresh) and the error goes on to vLLM.
            self._core.forget(request.request_id)
            raise

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """The chosen child gets ``num_external_tokens``, the others 0; all
        get the request's real blocks (as vLLM's MultiConnector does)."""
        chosen = self._core.allocated(request.request_id, num_external_tokens)
        if chosen is not None:
            self._loads.planned(request.request_id, blocks)
        try:
            for i in active_children(self, "update_state_after_alloc"):
                n = num_external_tokens if i == chosen else 0
                call_child(self, i, "update_state_after_alloc", request, blocks, n)
        except BaseException:
            self._core.forget(request.request_id)
            raise

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        chosen = self._core.chosen(request.request_id)
        if chosen is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return call_child(
            self, chosen, "get_external_cache_hit_sources", request, num_external_tokens
        )

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        chosen = self._core.chosen(request.request_id)
        if chosen is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return call_child(self, chosen, "get_loaded_kv_cache_group_ids", request)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        call_children(self, "bind_kv_cache_manager", kv_cache_manager)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvmuxMetadata:
        meta = KvmuxMetadata(
            children=tuple(call_children(self, "build_connector_meta", scheduler_output)),
            extra_async_saves=self._extra_saves or None,
            dropped_saves=self._dropped_saves or None,
        )
        self._extra_saves = {}
        self._dropped_saves = {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each child sees its own slice of the workers' metadata. Loads the
        workers report failed (``invalid_block_ids``, ``failed_recving``) stop
        counting in ``num_extra_cached_tokens``; vLLM handles the requests."""
        if self._load_blocks:  # some load is planned: did any fail?
            self._loads.check(
                self._core,
                connector_output.invalid_block_ids,
                getattr(connector_output, "failed_recving", None),
            )
        worker_meta = connector_output.kv_connector_worker_meta
        if worker_meta is not None and not isinstance(worker_meta, KvmuxWorkerMetadata):
            raise TypeError(
                f"kvmux got worker metadata of type {type(worker_meta).__name__}; "
                "the workers must run the same KvmuxConnector configuration"
            )
        try:
            for i in active_children(self, "update_connector_output"):
                if worker_meta is not None:
                    connector_output.kv_connector_worker_meta = worker_meta.children[i]
                call_child(self, i, "update_connector_output", connector_output)
        finally:
            connector_output.kv_connector_worker_meta = worker_meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finish(request, "request_finished", block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's finish for an HMA connector (kvmux is one), with the
        request's blocks per KV cache group. A child with HMA support gets
        every group (``request_finished_all_groups``); a child without gets
        ``request_finished`` with the one group's blocks, which are all of the
        request's blocks. Several groups with such a child raise
        :class:`KvmuxConfigError` naming them (never silently truncated; the
        constructor already refuses that model unless HMA is off)."""
        if self._all_hma:
            return self._finish(request, "request_finished_all_groups", block_ids)
        if len(block_ids) != 1:
            self._core.forget(request.request_id)
            raise KvmuxConfigError(
                f"request {request.request_id!r} holds KV in {len(block_ids)} cache "
                f"groups but children {self._cfg.non_hma_children()} do not support "
                "the hybrid KV cache manager and can be given only one (they would "
                f"lose the others); {HMA_FIX}, or use only HMA-capable children"
            )
        if not self._any_hma:
            return self._finish(request, "request_finished", block_ids[0])
        routes = [
            ("request_finished_all_groups", (block_ids,))
            if spec.supports_hma
            else ("request_finished", (block_ids[0],))
            for spec in self._cfg.children
        ]
        return self._finish(request, "request_finished_all_groups", block_ids, routes)

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        """True when any child keeps the request's blocks for a partial tail.
        Called on a request's way out, so a child that never took part in the
        request and fails is contained (see ``kvmux._containment``)."""
        try:
            answers, _ = call_children_on_exit(
                self,
                "register_finished_partial_tail",
                request,
                (block_ids, partial_tail_offloads),
                False,
            )
        except BaseException:
            self._core.forget(request.request_id)
            raise
        return any(answers)

    def _finish(
        self,
        request: Request,
        hook: str,
        block_ids: Any,
        routes: list[tuple[str, tuple[Any, ...]]] | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if self._load_blocks:
            self._load_blocks.pop(req_id, None)
        try:
            # A child that never took part and fails is contained; see _containment.
            if routes is None:
                results, contained = call_children_on_exit(
                    self, hook, request, (block_ids,), (False, None)
                )
            else:
                results, contained = call_each_on_exit(self, routes, request, (False, None))
        except BaseException:
            self._core.forget(req_id)
            raise
        if contained:
            self._dropped_saves[req_id] = tuple(contained)
        asked = getattr(request, "kv_transfer_params", None)
        want_extra = isinstance(asked, dict) and EXTRA_KEY in asked
        is_async, params, extra_saves, warn = self._core.finish(req_id, results, want_extra)
        if extra_saves:
            self._extra_saves[req_id] = extra_saves
        if warn:
            for key, first, second in warn:
                logger.warning(
                    "kvmux: children %r and %r both return kv_transfer_params key %r; "
                    "clash_policy %r keeps one (warned once per key)",
                    first,
                    second,
                    key,
                    self._cfg.clash_policy,
                )
        return is_async, params

    # ---------------------------------------------------------- worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        meta = self._own_metadata(connector_metadata)
        if meta.extra_async_saves:
            self._countdown.expect(meta.extra_async_saves)
        if meta.dropped_saves:
            self._dropped.expect(meta.dropped_saves)
        for i, child_meta in enumerate(meta.children):
            call_child(self, i, "bind_connector_metadata", child_meta)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        call_children(self, "clear_connector_metadata")
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        meta = self._own_metadata(kv_connector_metadata)
        for i, child_meta in enumerate(meta.children):
            call_child(self, i, "handle_preemptions", child_meta)

    def _own_metadata(self, meta: KVConnectorMetadata) -> KvmuxMetadata:
        if not isinstance(meta, KvmuxMetadata) or len(meta.children) != len(self._children):
            raise TypeError(
                f"kvmux got connector metadata {type(meta).__name__}; the scheduler "
                "and workers must run the same KvmuxConnector configuration"
            )
        return meta

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """A request is finished sending once every child that saved it
        asynchronously has reported it."""
        if _versions.HAS_TRANSFER_RESULTS:
            res = self.get_transfer_results(finished_req_ids)
            return res.finished_sending or None, res.finished_recving or None
        answers = call_children(self, "get_finished", finished_req_ids)
        done = self._complete_sends(snd for snd, _ in answers)
        recving = set().union(*(rcv or () for _, rcv in answers))
        return done or None, recving or None

    def _complete_sends(self, per_child: Iterable[Iterable[str] | None]) -> set[str]:
        """Every child's finished-sending ids of one step (in config order)
        -> the requests finished sending now: completions of contained
        children dropped, then the countdown of extra async saves."""
        sending: list[str] = []
        for i, snd in enumerate(per_child):
            if snd:
                sending.extend(self._dropped.filter(i, snd) if self._dropped else snd)
        done = self._countdown.complete(sending)
        if done:
            self._core.count_worker(len(done), 0)
        return done

    if _versions.HAS_TRANSFER_RESULTS:

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            out = _versions.TransferResults()
            answers = call_children(self, "get_transfer_results", finished_req_ids)
            for res in answers:
                out.finished_recving.update(res.finished_recving)
                out.failed_recving.update(res.failed_recving)
            out.finished_sending = self._complete_sends(r.finished_sending for r in answers)
            return out

    def build_connector_worker_meta(self) -> KvmuxWorkerMetadata | None:
        metas = call_children(self, "build_connector_worker_meta")
        if all(m is None for m in metas):
            return None
        return KvmuxWorkerMetadata(children=tuple(metas))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Stats of the last interval: kvmux's own counters (on the scheduler
        side, where its decisions are made) and each child's, by child name."""
        return build_child_stats(
            self._names, call_children(self, "get_kv_connector_stats"), self._core.take_interval()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed: set[int] = set()
        for blocks in call_children(self, "get_block_ids_with_load_errors"):
            failed |= set(blocks or ())
        if failed:
            self._core.count_worker(0, len(failed))
        return failed

    # vLLM calls these on the hot path per layer; they are instance attributes
    # bound in __init__ (see kvmux._fanout.layer_hook). The methods below are
    # what the class itself offers for the abstract interface.
    def wait_for_layer_load(self, layer_name: str) -> None:  # type: ignore[no-redef]
        for i in range(len(self._children)):
            call_child(self, i, "wait_for_layer_load", layer_name)

    def save_kv_layer(  # type: ignore[no-redef]
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        for i in range(len(self._children)):
            call_child(self, i, "save_kv_layer", layer_name, kv_layer, attn_metadata, **kwargs)
