"""``load_policy: "compose"``: each child, in order, is asked for the tokens
after the earlier children's hits and loads only its own span. Through
vLLM's real v1 ``Scheduler`` and workers (real tensors as the paged KV
cache, checked bit for bit against computing the prefix), with the host
tier, the real LMCache server (``tests/support/lmcache_server.py``) and vLLM's
``ExampleConnector``."""

from __future__ import annotations

import pytest

from kvmux import KvmuxConfigError
from kvmux._core import BY_CHILD_KEY, LOCAL_KEY
from kvmux.mux.config import parse_mux_config
from tests.mux.test_lmcache import (  # noqa: F401 (make_sim: a fixture)
    HOST,
    LM,
    PREFIX,
    host_child,
    kv_is_exact,
    make_sim,
    run,
    step_until_computed,
    store_prefix,
)
from tests.support.harness import child, mux_config, scripted

# vLLM's load rule on the simulator (composition, not the cost rule): see conftest.
pytestmark = pytest.mark.usefixtures("vllms_load_rule")

WANT = {"cached_tokens_by_child": True, "num_extra_cached_tokens": True}


def wipe_device(d) -> None:
    """vLLM's own prefix cache and the paged KV tensors, not the tiers."""
    assert d.scheduler.reset_prefix_cache()
    for kv in d.kv_caches.values():
        kv.zero_()


def test_the_host_tier_and_lmcache_load_consecutive_spans_byte_exact(
    lmcache_runs,
    lmcache_server,
    make_sim,  # noqa: F811
):
    """The host tier holds [0, 32), LMCache [0, 48): the host tier loads
    [0, 32), LMCache [32, 48), and the KV is what computing it gives."""
    d = make_sim([host_child(), lmcache_server.child()], load_policy="compose")
    store_prefix(d, "A", PREFIX[:32])  # both tiers: 2 blocks
    other = make_sim([lmcache_server.child()])  # LMCache alone gets the 3rd
    store_prefix(other, "A2", PREFIX)
    wipe_device(d)
    b = d.add("B", PREFIX + [9] * 5, kv_transfer_params=WANT)
    step_until_computed(d, b, len(PREFIX))
    assert kv_is_exact(d, "B", PREFIX)
    run(d)
    assert d.finished["B"][BY_CHILD_KEY] == {HOST: 32, LM: 16, LOCAL_KEY: 0}
    assert d.finished["B"]["num_extra_cached_tokens"] == 48
    st = d.connector.mux_stats()["children"]
    assert st[HOST]["load_tokens"] == 32 and st[LM]["load_tokens"] == 16
    assert d.connector.num_live_requests() == 0
    assert d.worker.num_pending_async_loads() == 0


def test_a_child_not_known_to_load_a_span_may_only_come_first(tmp_path):
    """Only children measured to load a span (the host tier, LMCache's MP
    connector: the test above) may follow another under ``compose``; any
    other is refused there, naming it and both fixes, unless its entry
    declares ``loads_spans``; first, it is accepted."""
    ex = child("ExampleConnector", shared_storage_path=str(tmp_path / "ex"))
    with pytest.raises(KvmuxConfigError) as err:
        parse_mux_config(mux_config([host_child(), ex], load_policy="compose"))
    text = str(err.value)
    assert "connectors[1] (ExampleConnector)" in text and "connectors[0]" in text
    assert "loads_spans" in text
    # Measured in a real engine: the refusal says why this one is not.
    assert "ExampleConnector was measured NOT to" in text and "over the span" in text
    for ok in ([ex, host_child()], [host_child(), {**ex, "loads_spans": True}]):
        parse_mux_config(mux_config(ok, load_policy="compose"))
    # The other policies have no spans: any order.
    parse_mux_config(mux_config([host_child(), ex], load_policy="first"))
    with pytest.raises(KvmuxConfigError, match="must be true or false"):
        parse_mux_config(mux_config([{**ex, "loads_spans": "yes"}]))


def test_a_failed_span_is_recomputed_from_its_first_block_never_a_hole(make_sim):  # noqa: F811
    """The host tier loads [0, 32), a scripted tier's span [32, 48) fails:
    vLLM recomputes from block 2; the KV is exact, only the host tier is
    credited, and the host tier does not keep the block that failed. (The
    scripted tier stands in for a remote tier whose load fails: it reports
    its span's blocks as load errors.)"""
    flaky = {**scripted(matched=48, fail_loads=True), "loads_spans": True}
    d = make_sim([host_child(), flaky], failure_policy="recompute", load_policy="compose")
    scripted_tier = d.connector.children[1]
    scripted_tier.script["matched"] = 0  # A is computed: the host tier saves 2 blocks
    store_prefix(d, "A", PREFIX[:32])
    scripted_tier.script["matched"] = 48
    wipe_device(d)
    b = d.add("B", PREFIX + [9] * 5, kv_transfer_params=WANT)
    step_until_computed(d, b, len(PREFIX))
    assert kv_is_exact(d, "B", PREFIX)
    run(d)
    assert d.finished["B"][BY_CHILD_KEY] == {HOST: 32, "ScriptedConnector": 0, LOCAL_KEY: 0}
    assert d.connector.children[1].calls.count(("alloc", ("B", 16))) == 1
    # The host tier saved B's blocks in the step the scripted span failed:
    # it must not keep block 2 as it was then (no KV there), or the next
    # request would get it.
    wipe_device(d)
    c = d.add("C", PREFIX + [7] * 5, kv_transfer_params=WANT)
    step_until_computed(d, c, len(PREFIX))
    assert kv_is_exact(d, "C", PREFIX)
    run(d)
    assert d.finished["C"][BY_CHILD_KEY][HOST] == 32


def promoted(lmcache_server, build, promote: bool):
    """B and C share a prefix only LMCache holds; vLLM's own cache and the
    device KV are wiped before each."""
    host = host_child()
    host["kv_connector_extra_config"]["promote"] = promote
    d = build([host, lmcache_server.child()])
    other = build([lmcache_server.child()])  # LMCache alone holds the prefix
    store_prefix(other, "A", PREFIX)
    for rid, tail in (("B", [9] * 5), ("C", [8] * 5)):
        wipe_device(d)
        r = d.add(rid, PREFIX + tail, kv_transfer_params=WANT)
        step_until_computed(d, r, len(PREFIX))
        assert kv_is_exact(d, rid, PREFIX)
        run(d)
    return d


def test_a_prefix_lmcache_served_once_is_served_by_the_host_tier_next(
    lmcache_runs,
    lmcache_server,
    make_sim,  # noqa: F811
):
    """Promotion: the blocks LMCache loaded are saved into the host tier as
    they arrive, so the next request for the prefix is served from host
    memory (byte-exact both times)."""
    d = promoted(lmcache_server, make_sim, promote=True)
    assert d.finished["B"][BY_CHILD_KEY] == {HOST: 0, LM: 48, LOCAL_KEY: 0}
    assert d.finished["C"][BY_CHILD_KEY] == {HOST: 48, LM: 0, LOCAL_KEY: 0}
    promoted_blocks = sum(
        s.get("children", {}).get(HOST, {}).get("data", {}).get("promoted_blocks", 0)
        for s in d.kv_stats
    )
    assert promoted_blocks == 3


def test_with_promote_off_lmcache_serves_it_again(lmcache_runs, lmcache_server, make_sim):  # noqa: F811
    d = promoted(lmcache_server, make_sim, promote=False)
    assert d.finished["C"][BY_CHILD_KEY] == {HOST: 0, LM: 48, LOCAL_KEY: 0}


def test_promote_must_be_a_bool():
    host = host_child()
    host["kv_connector_extra_config"]["promote"] = "yes"
    with pytest.raises(KvmuxConfigError, match="promote must be true or false"):
        parse_mux_config(mux_config([host]))
