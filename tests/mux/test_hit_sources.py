"""vLLM's own metrics under kvmux (issue 26): external hits split by the
tier that supplied them (``CacheHitSource``, ``vllm:prompt_tokens_cached_by_source``),
the host tier's capacity and usage gauges, through vLLM 0.33's real
``Scheduler`` and workers (``tests.support.harness``) and vLLM's real Prometheus
stat logger (``PrometheusStatLogger``, the one ``vllm serve`` runs, in this
process's registry). The model is the harness's one stand-in; a P2P child
(NIXL needs a GPU and a peer) is the scripted child declaring ``p2p`` as
NIXL does."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from prometheus_client import REGISTRY
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.loggers import PrometheusStatLogger

from kvmux import KvmuxChildError
from kvmux._core import BY_CHILD_KEY, LOCAL_KEY
from kvmux.host_cache import KvmuxHostCache
from tests.mux.test_lmcache import make_sim  # noqa: F401 (a fixture)
from tests.support.harness import SchedulerSim, mux_config, scripted

PREFIX = list(range(300, 348))  # 48 tokens: 3 blocks
HOST, P2P = "KvmuxHostCache", "ScriptedConnector"
WANT = {BY_CHILD_KEY: True}


def host_child(num_blocks: int = 64) -> dict[str, Any]:
    return {
        "kv_connector": HOST,
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_blocks": num_blocks},
    }


def p2p_child(**extra: Any) -> dict[str, Any]:
    """The stand-in P2P child; it loads from the tokens it is asked from
    (``loads_spans``, as a compose child after the host tier must)."""
    return {**scripted(hit_source="p2p", **extra), "loads_spans": True}


class Metrics:
    """vLLM's Prometheus logger fed every step's ``SchedulerStats``, as the
    engine's front end does, plus the hits-by-source split vLLM recorded."""

    def __init__(self, d: SchedulerSim) -> None:
        self.prom = PrometheusStatLogger(d.vllm_config)
        self.by_source: Counter[str] = Counter()
        make_stats = d.scheduler.make_stats

        def recorded(*a: Any, **kw: Any) -> Any:
            st = make_stats(*a, **kw)
            if st is not None:
                if st.connector_prefix_cache_stats is not None:
                    for src, n in st.connector_prefix_cache_stats.hits_by_source.items():
                        self.by_source[src.value] += n
                self.prom.record(st, None, engine_idx=0)
            return st

        d.scheduler.make_stats = recorded  # type: ignore[method-assign]

    def sample(self, name: str, **labels: str) -> float:
        """The registry's value of ``name`` for this engine's labels (engine 0
        and its model: earlier tests' engines left series of their own in
        the process-wide registry) and ``labels``."""
        model_name = str(self.prom.per_engine_labelvalues[0][0])
        want = {**labels, "engine": "0", "model_name": model_name}
        for metric in REGISTRY.collect():
            for s in metric.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in want.items()):
                    return s.value
        return 0.0


@pytest.fixture
def sims():
    built: list[SchedulerSim] = []

    def make(children: list[dict[str, Any]], **extra: Any) -> SchedulerSim:
        d = SchedulerSim(mux_config(children, **extra))
        built.append(d)
        return d

    yield make
    for d in built:
        d.close()


def store(d: SchedulerSim, tokens: list[int], req_id: str = "A") -> None:
    """A request that leaves ``tokens``' full blocks in the host tier; then
    vLLM's own prefix cache is reset, so only the tiers hold them."""
    d.add(req_id, tokens + [1, 2, 3], max_tokens=2)
    d.run()
    assert d.scheduler.reset_prefix_cache()


def scripted_child(d: SchedulerSim) -> Any:
    return d.connector.children[d.connector.child_names.index(P2P)]


def test_host_tier_hits_are_counted_as_host_in_vllms_metric(sims):
    d = sims([host_child()])
    m = Metrics(d)
    before = m.sample("vllm:prompt_tokens_cached_by_source_total", source="host")
    store(d, PREFIX)
    d.add("B", PREFIX + [9] * 5, kv_transfer_params=WANT)
    d.run()
    assert d.finished["B"][BY_CHILD_KEY] == {HOST: 48, LOCAL_KEY: 0}
    assert m.by_source == {"host": 48}
    assert m.sample("vllm:prompt_tokens_cached_by_source_total", source="host") - before == 48


def test_compose_splits_the_hits_by_the_span_each_child_supplied(sims):
    """The host tier holds [0, 32), the P2P child the rest: vLLM counts 32
    host and 16 p2p tokens, as many as each child supplied."""
    d = sims([host_child(), p2p_child()], load_policy="compose")
    m = Metrics(d)
    store(d, PREFIX[:32])
    scripted_child(d).script["matched"] = 48
    d.add("B", PREFIX + [9] * 5, kv_transfer_params=WANT)
    d.run()
    assert d.finished["B"][BY_CHILD_KEY] == {HOST: 32, P2P: 16, LOCAL_KEY: 0}
    assert m.by_source == {"host": 32, "p2p": 16}
    # Each child was asked about its own span only.
    assert ("hit_sources", ("B", 16)) in scripted_child(d).calls


@pytest.mark.parametrize("policy", ["first", "longest"])
def test_first_and_longest_credit_the_child_that_loaded(sims, policy):
    d = sims([host_child(), scripted(hit_source="p2p")], load_policy=policy)
    m = Metrics(d)
    store(d, PREFIX)
    # The P2P child has 32 tokens: under both policies the host tier's 48 load.
    scripted_child(d).script["matched"] = 32
    d.add("B", PREFIX + [9] * 5, kv_transfer_params=WANT)
    d.run()
    assert d.finished["B"][BY_CHILD_KEY] == {HOST: 48, P2P: 0, LOCAL_KEY: 0}
    assert m.by_source == {"host": 48}


def test_a_child_whose_split_is_wrong_counts_under_its_own_source(sims):
    """The P2P child answers a split of 5 tokens for its 16: its span is
    counted under its own source, the host tier's as host."""
    d = sims([host_child(), p2p_child(hit_split={"disk": 5})], load_policy="compose")
    m = Metrics(d)
    store(d, PREFIX[:32])
    scripted_child(d).script["matched"] = 48
    d.add("B", PREFIX + [9] * 5)
    d.run()
    assert m.by_source == {"host": 32, "p2p": 16}
    assert sum(m.by_source.values()) == 48


def test_a_child_whose_split_raises_is_named_with_the_hook(sims):
    """A child's own split runs inside vLLM's scheduler step (the core calls
    it, ``PySchedulerMux.get_external_cache_hit_sources``): its error reaches
    vLLM as a ``KvmuxChildError`` naming the child and the hook."""
    d = sims([host_child(), p2p_child(fail="get_external_cache_hit_sources")])
    scripted_child(d).script["matched"] = 48
    d.add("B", PREFIX + [9] * 5)
    with pytest.raises(KvmuxChildError) as err:
        d.run()
    assert err.value.child == P2P
    assert err.value.hook == "get_external_cache_hit_sources"
    assert "scripted failure" in str(err.value)


def test_the_host_tier_declares_host():
    assert KvmuxHostCache._cache_hit_source is CacheHitSource.HOST


# ----------------------------------------------------------------- gauges


def test_tier_gauges_reach_prometheus_and_kv_connector_stats(sims):
    """Capacity, used and pinned slots (and bytes), and each KV cache
    group's used slots: in the host tier's KVConnectorStats (rebuilt by vLLM's
    front-end path) and as ``kvmux_tier_*`` gauges beside kvmux's counters."""
    d = sims([host_child(num_blocks=64)])
    m = Metrics(d)
    store(d, PREFIX)
    d.step()  # an idle step: the latest gauges are reported
    from kvmux import KvmuxConnector

    acc = KvmuxConnector.build_kv_connector_stats(None)
    for payload in d.kv_stats:
        acc = acc.aggregate(KvmuxConnector.build_kv_connector_stats(payload))
    host = acc.children[HOST].data
    slot_bytes = host["tier.capacity_bytes"] // 64
    assert slot_bytes > 0
    assert host["tier.capacity_slots"] == 64
    assert host["tier.used_slots"] == 3 and host["tier.used_bytes"] == 3 * slot_bytes
    assert host["tier.pinned_slots"] == 0
    assert host["tier.group0.used_slots"] == 3
    # Gauges are not summed across reports: the latest one wins.
    assert acc.reduce()[f"{HOST}.tier.used_slots"] == 3
    s = m.sample
    assert s("kvmux_tier_capacity_slots", connector=HOST) == 64
    assert s("kvmux_tier_capacity_bytes", connector=HOST) == 64 * slot_bytes
    assert s("kvmux_tier_used_slots", connector=HOST) == 3
    assert s("kvmux_tier_used_bytes", connector=HOST) == 3 * slot_bytes
    assert s("kvmux_tier_pinned_slots", connector=HOST) == 0
    assert s("kvmux_tier_group_used_slots", connector=HOST, group="0") == 3
    # kvmux's own counters are beside them in the same registry.
    assert s("kvmux_finished_requests_total") >= 1


def test_under_compose_lmcaches_span_counts_under_its_own_source(
    lmcache_runs,
    lmcache_server,
    make_sim,  # noqa: F811
):
    """The real LMCache server (``tests/support/lmcache_server.py``) after the host
    tier: the host tier's [0, 32) counts as host, LMCache's [32, 48) under
    the source LMCache declares (none: external_unspecified)."""
    from tests.mux.test_compose import WANT as ASK
    from tests.mux.test_compose import wipe_device
    from tests.mux.test_lmcache import LM, step_until_computed, store_prefix
    from tests.mux.test_lmcache import run as drain

    d = make_sim([host_child(), lmcache_server.child()], load_policy="compose")
    m = Metrics(d)
    store_prefix(d, "A", PREFIX[:32])
    other = make_sim([lmcache_server.child()])
    store_prefix(other, "A2", PREFIX)
    wipe_device(d)
    b = d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
    step_until_computed(d, b, len(PREFIX))
    drain(d)
    assert d.finished["B"][BY_CHILD_KEY] == {HOST: 32, LM: 16, LOCAL_KEY: 0}
    assert m.by_source == {"host": 32, "external_unspecified": 16}
