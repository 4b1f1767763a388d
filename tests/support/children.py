"""The child connectors the overhead benchmarks (``benches/overhead``) put
under kvmux and under vLLM's ``MultiConnector`` (the same classes, configs
and inputs on both sides); the tests use the no-op one too
(``tests.support.harness.NOOP``). Not in the wheel.

They are real ``KVConnectorBase_V1`` subclasses, found by vLLM's connector
factory through ``kv_connector_module_path="tests.support.children"``; they
stand in for children whose own work is not what is being measured.

- :class:`NoopConnector`: every hook does nothing (a lookup matches 0 tokens,
  the metadata is an empty ``KVConnectorMetadata``): what remains is the
  multiplexer's own cost.
- :class:`LayerworkConnector`: a no-op child whose per-layer hooks do the
  bookkeeping a layer-wise connector does (count the layer waited for, note the
  layer saved), so a benchmark of the per-layer path has a child that works.
- :class:`StallConnector`: a no-op child whose lookups stall: it answers a
  request "not ready" for ``stall_ms`` of wall time after it was first asked
  about it, then a miss (a cache server answering slowly), so a benchmark can
  show what a stalled child costs the requests that ask it.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

__all__ = ["LayerworkConnector", "NoopConnector", "StallConnector"]


class NoopConnector(KVConnectorBase_V1):
    """A connector that does nothing, on either side."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        pass

    def wait_for_save(self) -> None:
        pass


class LayerworkConnector(NoopConnector):
    """A no-op connector whose per-layer hooks do a layer-wise connector's
    bookkeeping: which layer was waited for, which layer's KV was handed over."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layers_waited = 0
        self.last_saved: tuple[str, Any] | None = None

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.layers_waited += 1

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        self.last_saved = (layer_name, kv_layer)


class StallConnector(NoopConnector):
    """A no-op connector whose lookup of each request answers "not ready"
    (``None``) until ``stall_ms`` (``kv_connector_extra_config``, default
    250) of wall time have passed since its first lookup of that request,
    then a miss (0 tokens). vLLM's scheduler skips a request whose lookup is
    not ready and asks again on its next step, so the stall holds the request
    for as long as its connector keeps asking this child."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.stall_s = float(extra.get("stall_ms", 250)) / 1000
        self.first_asked: dict[str, float] = {}
        """Request id -> when it was first looked up (until it finishes)."""
        self.lookups = 0
        self.stalled = 0
        """Lookups answered "not ready"."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        now = time.monotonic()
        since = self.first_asked.setdefault(request.request_id, now)
        self.lookups += 1
        if now - since < self.stall_s:
            self.stalled += 1
            return None, False
        return 0, False

    def request_finished(self, request: Any, block_ids: Any):
        self.first_asked.pop(request.request_id, None)
        return False, None
