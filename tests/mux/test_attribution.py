"""Per-tier attribution: a request asking ``cached_tokens_by_child`` gets
back the tokens each child and vLLM's local prefix cache supplied; the same
split is counted (``served_tokens``, ``local_cached_tokens``) and exported
to Prometheus. Through vLLM's real v1 ``Scheduler`` and workers, with the
host tier and the real LMCache server (``tests/support/lmcache_server.py``)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

from kvmux import KvmuxConnector
from kvmux._core import BY_CHILD_KEY, LOCAL_KEY
from tests.mux.test_lmcache import (  # noqa: F401 (make_sim: a fixture)
    ASK,
    HOST,
    LM,
    PREFIX,
    forget_locally,
    host_child,
    make_sim,
    run,
    store_prefix,
)
from tests.support.harness import mux_config, scripted

# vLLM's load rule on the simulator: see conftest.
pytestmark = pytest.mark.usefixtures("vllms_load_rule")

WANT = {"cached_tokens_by_child": True, "num_extra_cached_tokens": True}
SCRIPTED = "ScriptedConnector"


def totals(d):
    acc = KvmuxConnector.build_kv_connector_stats(None)
    for payload in d.kv_stats:
        acc = acc.aggregate(KvmuxConnector.build_kv_connector_stats(payload))
    return acc.counters


def test_each_tier_and_the_local_cache_are_credited(driver_factory):
    prompt = list(range(500, 564))  # 64 tokens: 4 blocks
    d = driver_factory(mux_config([host_child(), scripted(matched=32)], load_policy="longest"))
    # 1: nobody holds it but the scripted tier (2 blocks); the host tier saves it.
    d.add("a", prompt, kv_transfer_params=WANT)
    d.run()
    assert d.finished["a"][BY_CHILD_KEY] == {HOST: 0, SCRIPTED: 32, LOCAL_KEY: 0}
    assert d.finished["a"]["num_extra_cached_tokens"] == 32
    # 2: vLLM's own prefix cache holds it now.
    d.add("b", prompt, kv_transfer_params=WANT)
    d.run()
    b = d.finished["b"][BY_CHILD_KEY]
    assert b[LOCAL_KEY] == 48 and b[HOST] == b[SCRIPTED] == 0
    # 3: vLLM's cache wiped: the host tier holds more than the scripted tier.
    assert d.scheduler.reset_prefix_cache()
    d.add("c", prompt, kv_transfer_params=WANT)
    d.run()
    c = d.finished["c"]
    assert c[BY_CHILD_KEY] == {HOST: 48, SCRIPTED: 0, LOCAL_KEY: 0}
    assert (
        sum(v for k, v in c[BY_CHILD_KEY].items() if k != LOCAL_KEY)
        == (c["num_extra_cached_tokens"])
    )
    # Not asked: no key, but counted all the same.
    d.add("d", list(range(700, 764)))
    d.run()
    assert d.finished["d"] is None
    k = totals(d)
    assert k["children"][HOST]["served_tokens"] == 48
    assert k["children"][SCRIPTED]["served_tokens"] == 32 * 2  # "a" and "d"
    assert k["local_cached_tokens"] == 48
    labels = {"model_name": "tiny", "engine": "0"}
    before = (
        REGISTRY.get_sample_value("kvmux_served_tokens_total", {**labels, "connector": HOST}) or 0.0
    )
    prom = KVConnectorProm(d.vllm_config, ["model_name", "engine"], {0: ["tiny", 0]})
    for payload in d.kv_stats:
        prom.observe(payload, engine_idx=0)
    after = REGISTRY.get_sample_value("kvmux_served_tokens_total", {**labels, "connector": HOST})
    assert after - before == 48


def test_a_failed_load_is_not_credited(driver_factory):
    ktc = mux_config([scripted(matched=32, fail_loads=True)])
    ktc.kv_load_failure_policy = "recompute"  # vLLM recomputes what failed
    d = driver_factory(ktc)
    d.add("a", list(range(900, 940)), kv_transfer_params=WANT)
    d.run()
    got = d.finished["a"][BY_CHILD_KEY]
    assert got[SCRIPTED] == 0 == d.finished["a"]["num_extra_cached_tokens"]


def test_lmcache_and_the_host_tier_are_credited_side_by_side(
    lmcache_runs,
    lmcache_server,
    make_sim,  # noqa: F811
):
    """LMCache holds the prefix after a local wipe: it is credited; once
    vLLM's own cache holds it, the local prefix cache is."""
    d = make_sim([lmcache_server.child(), host_child()])
    store_prefix(d)
    forget_locally(d)
    d.add("B", PREFIX + [9] * 5, kv_transfer_params={**ASK, **WANT})
    run(d)
    d.add("C", PREFIX + [8] * 5, kv_transfer_params={**ASK, **WANT})
    run(d)
    b, c = d.finished["B"], d.finished["C"]
    assert b[BY_CHILD_KEY] == {LM: 48, HOST: 0, LOCAL_KEY: 0}
    assert b["cached_token_stats"]["num_lmcache_extra_cached_tokens"] == 48
    assert c[BY_CHILD_KEY] == {LM: 0, HOST: 0, LOCAL_KEY: 48}
    assert c["cached_token_stats"]["num_vllm_cached_tokens"] == 48
