"""Save admission (a child entry's ``save_policy``) and waits that learn
their yield (``load_decision: "cost"``), driven through vLLM's real v1
``Scheduler`` (the rules: ``rust/mux/admit.rs``, ``rust/mux/cost.rs``;
applied in ``rust/mux/scheduler/saves.rs`` and ``decision.rs``; their own
cargo tests cover the table, its bound and the probes).

A child declined a request's save gets, in ``build_connector_meta``, the
step without that request (``kvmux.mux.scheduler.without_requests``): the
scripted child records what it saw scheduled (``scheduled``), which is what
a real connector plans its saves from.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from vllm.v1.core.sched.output import CachedRequestData

from kvmux import KvmuxConfigError
from kvmux.mux.config import parse_mux_config
from kvmux.mux.scheduler import without_requests
from kvmux.mux.stats import METRICS, KvmuxStats
from tests.support.harness import mux_config, scripted

PROMPT = list(range(100, 164))  # 64 tokens: 4 full blocks
HOST, SLOW = "ScriptedConnector#0", "ScriptedConnector#1"


def two_tiers(slow_policy=None, host_policy=None, **slow):
    host = scripted(async_save=True)
    tier = scripted(async_save=True, report_all_finished=True, **slow)
    if host_policy is not None:
        host["save_policy"] = host_policy
    if slow_policy is not None:
        tier["save_policy"] = slow_policy
    return [host, tier]


def counters(d, name):
    return d.connector.mux_stats()["children"][name]


def test_save_policy_is_checked_with_the_value_and_the_fix():
    for bad in ("sometimes", 0, -2, True, 1.5, "2"):
        children = two_tiers(slow_policy=bad)
        with pytest.raises(KvmuxConfigError) as e:
            parse_mux_config(mux_config(children))
        msg = str(e.value)
        assert f"save_policy={bad!r} is not valid" in msg, msg
        assert '"always"' in msg and '"auto"' in msg and "int >= 1" in msg
    with pytest.raises(KvmuxConfigError, match="did you mean 'auto'"):
        parse_mux_config(mux_config(two_tiers(slow_policy="autp")))
    for ok in ("always", "auto", 1, 3):
        cfg = parse_mux_config(mux_config(two_tiers(slow_policy=ok)))
        assert cfg.children[1].save_policy == ok
    cfg = parse_mux_config(mux_config(two_tiers()))
    assert [c.save_policy for c in cfg.children] == ["auto", "auto"], "the rule by default"
    # An unknown key in a child entry is still refused.
    children = two_tiers()
    children[1]["save_polcy"] = "auto"
    with pytest.raises(KvmuxConfigError, match="save_polcy"):
        parse_mux_config(mux_config(children))


def test_a_prefix_seen_once_is_saved_to_the_host_tier_only_twice_to_both(driver_factory):
    d = driver_factory(mux_config(two_tiers(slow_policy="auto", host_policy="auto")))
    host, slow = d.connector.children
    d.add("a", PROMPT)
    d.run()
    assert "a" in host.scheduled, "the first tier takes every save"
    assert "a" not in slow.scheduled, "a prefix seen once is not written to the slower tier"
    # Its async save answer was not waited for: nothing pending, no state.
    assert ("finished", "a") in slow.calls  # still told, to release its state
    assert d.connector.num_pending_async_saves() == 0
    assert d.connector.num_live_requests() == 0
    assert "a" in d.finished_sending  # the host tier's save completed
    assert counters(d, SLOW)["declined_saves"] == 1
    assert counters(d, HOST)["declined_saves"] == 0
    assert counters(d, SLOW)["async_saves"] == 0
    # Seen a second time (vLLM's prefix cache holds it): written to both.
    d.add("b", PROMPT + [7, 8])
    d.run()
    assert "b" in host.scheduled and "b" in slow.scheduled
    assert counters(d, SLOW)["declined_saves"] == 1
    assert counters(d, SLOW)["async_saves"] == 1
    assert d.connector.num_pending_async_saves() == 0
    assert d.connector.num_live_requests() == 0
    # Outputs do not change: the same tokens as with every save taken.
    ref = driver_factory(mux_config(two_tiers(slow_policy="always")))
    ref.add("a", PROMPT)
    ref.run()
    ref.add("b", PROMPT + [7, 8])
    ref.run()
    assert d.outputs == ref.outputs
    assert d.connector.mux_stats()["save_table_blocks"] > 0


def test_by_default_a_prefix_seen_once_reaches_the_first_tier_only(driver_factory):
    d = driver_factory(mux_config(two_tiers()))
    host, slow = d.connector.children
    d.add("a", PROMPT)
    d.run()
    assert "a" in host.scheduled and "a" not in slow.scheduled
    assert counters(d, SLOW)["declined_saves"] == 1


def test_save_policy_always_forces_every_save(driver_factory):
    d = driver_factory(mux_config(two_tiers(slow_policy="always", host_policy="auto")))
    host, slow = d.connector.children
    d.add("a", PROMPT)
    d.run()
    assert "a" in host.scheduled and "a" in slow.scheduled
    assert counters(d, SLOW)["declined_saves"] == 0
    assert counters(d, SLOW)["async_saves"] == 1
    assert d.connector.mux_stats()["save_table_blocks"] == 0, "nothing to count"


def test_a_reuse_threshold_applies_to_any_child_and_to_the_first_one(driver_factory):
    d = driver_factory(mux_config(two_tiers(slow_policy=3, host_policy=1)))
    host, slow = d.connector.children
    for k in range(3):
        d.add(f"r{k}", PROMPT + [k])
        d.run()
    assert all(f"r{k}" in host.scheduled for k in range(3)), "1: what it lacks, seen once"
    assert [f"r{k}" in slow.scheduled for k in range(3)] == [False, False, True]


def test_a_save_the_request_asks_for_is_never_declined(driver_factory):
    d = driver_factory(mux_config(two_tiers(slow_policy="auto")))
    d.add("pd", PROMPT, kv_transfer_params={"do_remote_decode": True})
    d.run()
    assert "pd" in d.connector.children[1].scheduled
    assert counters(d, SLOW)["declined_saves"] == 0


def test_a_child_that_loads_the_request_still_sees_it(driver_factory):
    d = driver_factory(mux_config(two_tiers(slow_policy="auto", matched=48)))
    slow = d.connector.children[1]
    d.add("hit", PROMPT)
    d.run()
    assert ("alloc", ("hit", 48)) in slow.calls
    assert "hit" in slow.scheduled
    assert counters(d, SLOW)["declined_saves"] == 0


def test_the_timeline_says_why_a_save_was_declined(driver_factory, tmp_path):
    path = tmp_path / "t.jsonl"
    d = driver_factory(mux_config(two_tiers(slow_policy="auto"), timeline_path=str(path)))
    d.add("a", PROMPT)
    d.run()
    (t,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert [c["save_declined"] for c in t["children"]] == [None, "not_reused"]


def test_the_view_drops_only_the_hidden_requests():
    # vLLM 0.33's fields; 0.34 has no resumed_req_ids nor all_token_ids.
    values: dict[str, Any] = {
        "req_ids": ["x", "y"],
        "resumed_req_ids": {"y"},
        "new_token_ids": [[1], [2]],
        "all_token_ids": {"y": [2]},
        "new_block_ids": [None, ([3],)],
        "num_computed_tokens": [10, 20],
        "num_output_tokens": [1, 2],
    }
    names = {f.name for f in dataclasses.fields(CachedRequestData)}
    cached = CachedRequestData(**{k: v for k, v in values.items() if k in names})

    class Out:
        scheduled_new_reqs = [type("N", (), {"req_id": "n"})(), type("N", (), {"req_id": "m"})()]
        scheduled_cached_reqs = cached
        num_scheduled_tokens = {"n": 16, "m": 8, "x": 1, "y": 1}
        total_num_scheduled_tokens = 26
        scheduled_spec_decode_tokens = {"y": [5]}
        finished_req_ids = {"z"}

    so = Out()
    v = without_requests(so, {"m", "y"})
    assert [r.req_id for r in v.scheduled_new_reqs] == ["n"]
    c = v.scheduled_cached_reqs
    assert c.req_ids == ["x"] and c.num_computed_tokens == [10] and c.new_block_ids == [None]
    if "resumed_req_ids" in names:
        assert c.resumed_req_ids == set() and c.all_token_ids == {}
    assert v.num_scheduled_tokens == {"n": 16, "x": 1} and v.total_num_scheduled_tokens == 17
    assert v.scheduled_spec_decode_tokens == {} and v.finished_req_ids == {"z"}
    # The original is untouched.
    assert so.num_scheduled_tokens["m"] == 8 and cached.req_ids == ["x", "y"]


def test_the_new_counters_are_prometheus_counters():
    names = {m[0] for m in METRICS}
    assert {"kvmux_declined_saves", "kvmux_declined_waits"} <= names
    s = KvmuxStats(data={"kvmux": {"children": {SLOW: {"declined_saves": 2}}}})
    assert s.reduce()


# ----------------------------------------------------------- waits that learn

#: An engine whose compute costs 1 ms per prompt token (the sim's model
#: costs next to nothing): 128 tokens compute in ~0.13 s, far longer than a
#: "not ready" answer's wait of an engine step or two.
ENGINE = scripted(step_s_per_token=0.001)
LONG = 128


def requests_waited_for(d, child, n, first=0):
    """Run ``n`` fresh requests one by one; which of them ``child`` was
    asked about more than once (its "not ready" answer was waited for)."""
    out = []
    for k in range(first, first + n):
        rid = f"q{k}"
        d.add(rid, [1000 + 7 * k + j for j in range(LONG)])
        d.run()
        out.append(child.calls.count(("lookup", rid)) > 1)
    return out


def test_a_not_ready_child_that_never_serves_stops_being_waited_for_and_is_probed(
    driver_factory, tmp_path
):
    path = tmp_path / "t.jsonl"
    cfg = mux_config(
        [ENGINE, scripted(matched=0, not_ready=2)],
        load_decision="cost",
        timeline_path=str(path),
    )
    d = driver_factory(cfg)
    slow = d.connector.children[1]
    waited = requests_waited_for(d, slow, 24)
    # Waited for while it is being learned, then declined, probed every 8th.
    assert all(waited[:3]), waited
    later = waited[6:]
    assert later.count(False) >= len(later) - 3, waited
    assert 1 <= later.count(True), f"never probed: {waited}"
    stats = counters(d, "ScriptedConnector#1")
    assert stats["declined_waits"] >= len(later) - 3
    learned = d.connector.mux_stats()["load_decision"]["children"]["ScriptedConnector#1"]
    assert learned["not_ready_yield_tokens"] < 1
    reasons = [json.loads(x)["children"][1]["declined"] for x in path.read_text().splitlines()]
    assert "no_yield" in reasons, reasons
    # It recovers: its answers end in tokens again; the probes see it.
    slow.script["matched"] = 96
    again = requests_waited_for(d, slow, 24, first=100)
    assert all(again[-6:]), again


def test_a_not_ready_child_that_serves_is_waited_for_throughout(driver_factory):
    cfg = mux_config([ENGINE, scripted(matched=96, not_ready=2)], load_decision="cost")
    d = driver_factory(cfg)
    slow = d.connector.children[1]
    assert all(requests_waited_for(d, slow, 12))
    assert counters(d, "ScriptedConnector#1")["declined_waits"] == 0


@pytest.mark.parametrize(
    ("name", "role"),
    [
        ("NixlConnector", "kv_both"),
        ("NixlPullConnector", "kv_both"),
        ("NixlPushConnector", "kv_consumer"),
        ("NixlPushConnector", "kv_both"),
        ("ExampleConnector", "kv_consumer"),  # a consumer never saves: no storage tier
    ],
)
def test_a_pd_transport_listed_first_leaves_the_host_tier_the_first_storage_tier(name, role):
    """docs/pd-nixl.md's push decode lists NIXL (``NixlPushConnector``,
    ``kv_consumer``) before the host tier: under ``auto`` the host tier is
    still the first storage tier, so it saves what NIXL pushed on first
    sight (tests/pd/test_push.py found it declined when only
    ``NixlConnector`` was known as a transport)."""
    host = {
        "kv_connector": "KvmuxHostCache",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_blocks": 64},
    }
    cfg = parse_mux_config(mux_config([{"kv_connector": name, "kv_role": role}, host]))
    assert [c.transport for c in cfg.children] == [True, False]
