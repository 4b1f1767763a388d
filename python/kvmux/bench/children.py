"""The child connectors the benchmarks put under kvmux and under vLLM's
``MultiConnector`` (the same classes, configs and inputs on both sides).

They are real ``KVConnectorBase_V1`` subclasses, found by vLLM's connector
factory through ``kv_connector_module_path="kvmux.bench.children"``; they
stand in for children whose own work is not what is being measured.

- :class:`NoopConnector`: every hook does nothing (a lookup matches 0 tokens,
  the metadata is an empty ``KVConnectorMetadata``): what remains is the
  multiplexer's own cost.
- :class:`LayerworkConnector`: a no-op child whose per-layer hooks do the
  bookkeeping a layer-wise connector does (count the layer waited for, note the
  layer saved), so a benchmark of the per-layer path has a child that works.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

__all__ = ["LayerworkConnector", "NoopConnector"]


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
