"""kvmux's stats and Prometheus metrics through vLLM's own paths: worker
outputs aggregated by vLLM's ``KVOutputAggregator``, the scheduler's stats
payload, ``build_kv_connector_stats`` in the front end, ``KVConnectorLogging``
for the log line and ``KVConnectorProm`` for Prometheus (a real registry)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)

from kvmux import KvmuxConnector
from kvmux.mux.stats import METRICS, KvmuxStats
from tests.support.harness import mux_config, scripted

# A later child must save what it sees once (vLLM's rule): see conftest.
pytestmark = pytest.mark.usefixtures("every_child_saves")

PREFIX = list(range(300, 348))  # 3 blocks


def host_child():
    return {
        "kv_connector": "KvmuxHostCache",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_blocks": 64},
    }


def run_workload(driver_factory, workers=1, **extra):
    d = driver_factory(
        mux_config([host_child(), scripted(async_save=True, params={"x": 1})], **extra),
        workers=workers,
    )
    d.add("A", PREFIX + [1], kv_transfer_params={"num_extra_cached_tokens": 1})
    d.run()
    d.scheduler.reset_prefix_cache()
    d.add("B", PREFIX + [2], kv_transfer_params={"num_extra_cached_tokens": 1})
    d.add("C", list(range(900, 940)))
    # 45 prompt tokens + 3 computed outputs: its 3rd block fills in its last
    # step, so both children are still saving when it finishes.
    d.add("D", list(range(700, 745)))
    d.run()
    return d


def total(d):
    """What the front end accumulates over the run (vLLM's own rebuild path)."""
    acc = KvmuxConnector.build_kv_connector_stats(None)
    for payload in d.kv_stats:
        acc = acc.aggregate(KvmuxConnector.build_kv_connector_stats(payload))
    return acc


def test_counters_per_child_and_totals_reach_the_front_end(driver_factory):
    d = run_workload(driver_factory)
    s = total(d)
    k = s.counters
    assert k["finished"] == 4
    assert k["extra_cached_tokens"] == 48
    assert k["children"]["KvmuxHostCache"]["loads"] == 1
    assert k["children"]["KvmuxHostCache"]["load_tokens"] == 48
    assert k["children"]["KvmuxHostCache"]["hits"] == 1
    assert k["children"]["ScriptedConnector"]["lookups"] == 4
    assert k["children"]["ScriptedConnector"]["async_saves"] == 4
    assert k["children"]["KvmuxHostCache"]["async_saves"] == 1
    assert k["extra_async_saves"] == 1  # D: two children saving
    assert k["finished_sending"] == 4
    # The host tier's own stats, rebuilt by its own class, are kept beside.
    host = s.children["KvmuxHostCache"]
    assert type(host).__name__ == "HostCacheStats"
    assert host.data["loaded_tokens"] == 48 and host.data["stored_blocks"] >= 3


def test_two_workers_aggregate_to_the_sum(driver_factory):
    """Tensor-parallel ranks: each worker reports its own copies; vLLM's
    aggregator sums them and reports a request finished sending once."""
    one, two = total(run_workload(driver_factory)), total(run_workload(driver_factory, workers=2))
    h1, h2 = one.children["KvmuxHostCache"].data, two.children["KvmuxHostCache"].data
    assert h2["bytes_saved"] == 2 * h1["bytes_saved"]
    assert h2["bytes_loaded"] == 2 * h1["bytes_loaded"]
    assert h2["stored_blocks"] == h1["stored_blocks"]  # scheduler-side: once
    assert two.counters["finished_sending"] == 2 * one.counters["finished_sending"]
    assert two.counters["finished"] == one.counters["finished"]


def test_stats_survive_the_serialised_round_trip(driver_factory):
    d = run_workload(driver_factory)
    s = total(d)
    wire = json.loads(json.dumps(s.to_dict()))
    back = KvmuxConnector.build_kv_connector_stats(wire)
    assert isinstance(back, KvmuxStats)
    assert back.reduce() == s.reduce()
    assert back.to_dict() == s.to_dict()


def test_the_periodic_log_line_shows_kvmuxs_numbers(driver_factory, caplog):
    d = run_workload(driver_factory)
    logging_ = KVConnectorLogging(d.vllm_config.kv_transfer_config)
    for payload in d.kv_stats:
        logging_.observe(payload)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    assert len(lines) == 1
    line = lines[0]
    assert "kvmux.finished=4" in line
    assert "kvmux.children.KvmuxHostCache.load_tokens=48" in line
    assert "KvmuxHostCache.loaded_tokens=48" in line


@pytest.fixture
def prom_labels():
    return ["model_name", "engine"], {0: ["tiny", 0]}


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})


def test_prometheus_registry_exposes_the_documented_metrics(driver_factory, prom_labels):
    d = run_workload(driver_factory, clash_policy="first")
    before = sample("kvmux_finished_requests_total") or 0.0
    hits_before = sample("kvmux_loaded_tokens_total", connector="KvmuxHostCache") or 0.0
    prom = KVConnectorProm(d.vllm_config, *prom_labels)
    for payload in d.kv_stats:
        prom.observe(payload, engine_idx=0)
    names = {m.name for m in REGISTRY.collect()}
    for name, *_ in METRICS:
        assert name in names, name
    assert sample("kvmux_finished_requests_total") - before == 4
    assert sample("kvmux_loaded_tokens_total", connector="KvmuxHostCache") - hits_before == 48
    assert sample("kvmux_lookups_total", connector="ScriptedConnector") >= 4
    assert sample("kvmux_extra_cached_tokens_total") >= 48
    # A second engine in the same process reuses the registered metrics.
    KVConnectorProm(d.vllm_config, *prom_labels).observe(d.kv_stats[0], engine_idx=0)


def test_clashes_are_counted_by_policy(driver_factory, prom_labels):
    d = driver_factory(
        mux_config([scripted(params={"k": 1}), scripted(params={"k": 2})], clash_policy="last")
    )
    for i in range(3):
        d.add(f"r{i}", list(range(20)))
    d.run()
    assert total(d).counters["clashes"] == {"last": 3}
    before = sample("kvmux_param_clashes_total", policy="last") or 0.0
    prom = KVConnectorProm(d.vllm_config, *prom_labels)
    for payload in d.kv_stats:
        prom.observe(payload, engine_idx=0)
    assert sample("kvmux_param_clashes_total", policy="last") - before == 3
