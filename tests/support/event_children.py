"""Children that report KV cache events, for kvmux's event tests.

Real ``KVConnectorBase_V1`` subclasses built by vLLM's factory, moving no KV:
each reports a ``BlockStored`` for every block of a request as it fills, as a
tier that stores everything would, on one of vLLM's two event paths:

- :class:`SchedulerEventsConnector` from its scheduler side
  (``take_events``, as vLLM's ``OffloadingConnector`` does);
- :class:`WorkerEventsConnector` from its workers
  (``get_kv_connector_kv_cache_events``, collected on the scheduler side in
  ``update_connector_output`` and published from ``take_events``: the
  shape of vLLM's ``LMCacheConnectorV1``), with a container of its own
  class: vLLM's ``LMCacheKVEvents`` (only the events every worker reported)
  or, with ``"keep_all": true``, :class:`KeepAllKVEvents` (every worker's
  copy, as a container that does not collapse them).

``kv_connector_extra_config``: ``medium`` (default ``"STORAGE"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import (
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheKVEvents
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash


class KeepAllKVEvents(KVConnectorKVEvents):
    """A container that keeps every worker's events, duplicates included."""

    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> KeepAllKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._agg.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._agg.get_number_of_workers()

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()


class _StoreMeta(KVConnectorMetadata):
    def __init__(self, events: list[BlockStored]) -> None:
        self.events = events


class _Stores(KVConnectorBase_V1):
    """The scheduler side both children share: a ``BlockStored`` per newly
    full block of every scheduled request, built in ``build_connector_meta``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.medium: str = extra.get("medium", "STORAGE")
        self.block_size: int = vllm_config.cache_config.block_size
        self._reqs: dict[str, Any] = {}
        self._reported: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self._reqs[request.request_id] = request

    def request_finished(self, request: Any, block_ids: Any):
        self._reqs.pop(request.request_id, None)
        self._reported.pop(request.request_id, None)
        return False, None

    def new_stores(self, scheduler_output: Any) -> list[BlockStored]:
        out = []
        bs = self.block_size
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self._reqs.get(req_id)
            if req is None:
                continue
            full = min((req.num_computed_tokens + n) // bs, len(req.block_hashes))
            first = self._reported.get(req_id, 0)
            if full <= first:
                continue
            self._reported[req_id] = full
            hashes = req.block_hashes
            out.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:full]],
                    parent_block_hash=(
                        maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None
                    ),
                    token_ids=list(req.all_token_ids[first * bs : full * bs]),
                    block_size=bs,
                    lora_id=None,
                    medium=self.medium,
                    lora_name=None,
                )
            )
        return out

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any):
        return None

    def wait_for_save(self) -> None:
        return None


class SchedulerEventsConnector(_Stores):
    """Reports its stores from the scheduler side (``take_events``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._queue: list[KVCacheEvent] = []

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        # The blocks the step fills, reported once it ran (take_events).
        self._queue.extend(self.new_stores(scheduler_output))
        return KVConnectorMetadata()

    def take_events(self) -> Iterable[KVCacheEvent]:
        out, self._queue = self._queue, []
        return out


class WorkerEventsConnector(_Stores):
    """Reports its stores from its workers (``get_kv_connector_kv_cache_events``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.container = KeepAllKVEvents if extra.get("keep_all") else LMCacheKVEvents
        self._collected: KVConnectorKVEvents | None = None
        self._step_events: list[BlockStored] = []

    # scheduler side
    def build_connector_meta(self, scheduler_output: Any) -> _StoreMeta:
        return _StoreMeta(self.new_stores(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        events = connector_output.kv_cache_events
        if not events or not isinstance(events, self.container):
            return
        if self._collected is None:
            self._collected = events
        else:
            self._collected.add_events(events.get_all_events())
            self._collected.increment_workers(events.get_number_of_workers())

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self._collected is not None:
            self._collected.aggregate()
            yield from self._collected.get_all_events()
            self._collected.clear_events()
            self._collected = None

    # worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step_events = list(getattr(connector_metadata, "events", []))

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        if not self._step_events:
            return None
        out = self.container(num_workers=1)
        out.add_events(self._step_events)
        self._step_events = []
        return out
