"""A second child for the end-to-end tests that returns ``kv_transfer_params``
of its own, as a disaggregated-prefill connector (NIXL, Mooncake) does for
its router. Those need a remote peer and RDMA, which this machine cannot run,
so this child moves no KV: it only answers ``request_finished`` with
``{"tagged_by": "TaggingConnector", "prompt_tokens": N}``. Everything else
about it is a real connector vLLM loads through ``kv_connector_module_path``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class TaggingConnector(KVConnectorBase_V1):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]):
        return False, {"tagged_by": "TaggingConnector", "prompt_tokens": request.num_prompt_tokens}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any):
        return None

    def wait_for_save(self) -> None:
        return None
