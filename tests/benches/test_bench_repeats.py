"""The pure parts of ``bench serve`` and ``bench fleet`` with repeats
(issue 35): the rotated order, the paired ratios and their spread line,
prompt lengths to rounds, the cost systems' configs, the pays workload's
sizes, and the fleet's aggregation of repeats into ratios. No server runs."""

from __future__ import annotations

from typing import Any

import pytest

from kvmux.bench import fleet, serve


def test_order_rotates_so_each_system_takes_each_place():
    names = ["shared-l2", "shared-l2-cost", "l1-only"]
    orders = [serve.order(names, k) for k in range(3)]
    assert orders[0] == names
    assert orders[1] == ["shared-l2-cost", "l1-only", "shared-l2"]
    for pos in range(3):
        assert sorted(o[pos] for o in orders) == sorted(names)
    assert serve.order(names, 3) == names and serve.order([], 2) == []


def test_paired_ratios_pair_by_repeat():
    a = [{"repeat": 0, "v": 2.0}, {"repeat": 1, "v": 3.0}, {"repeat": 2, "v": 1.0}]
    b = [{"repeat": 0, "v": 1.0}, {"repeat": 2, "v": 4.0}]  # repeat 1 failed
    assert serve.paired(a, b, lambda r: r["v"]) == [2.0, 0.25]
    sp = serve.median_spread([1.01, 0.91, 1.10])
    assert sp["median"] == 1.01 and sp["min"] == 0.91 and sp["max"] == 1.10
    assert serve.format_spread([1.01, 0.912, 1.104]) == (
        "    over 3 repeats: 0.912-1.104 (1.01, 0.91, 1.10)"
    )


def test_round_of_prompt_length():
    w = serve.ServeWorkload()  # context 2048, question 48, answer 16, 3 rounds
    assert [w.round_of(2048 + 48 + r * 64) for r in range(3)] == [0, 1, 2]
    assert w.round_of(2048 + 48 + 3 * 64) is None  # past the last round
    assert w.round_of(2048 + 16) is None and w.round_of(32) is None


def test_cost_systems_config():
    ktc = serve.system_config("kvmux-compose-cost", 1.0, 5555, "/tmp/t.jsonl")
    assert ktc is not None
    extra = ktc["kv_connector_extra_config"]
    assert extra["load_policy"] == "compose" and extra["load_decision"] == "cost"
    assert extra["timeline_path"] == "/tmp/t.jsonl"
    assert [c["kv_connector"] for c in extra["connectors"]] == [
        "KvmuxHostCache",
        "LMCacheMPConnector",
    ]
    plain = serve.system_config("kvmux-first", 1.0, 5555)
    assert plain is not None
    assert "load_decision" not in plain["kv_connector_extra_config"]
    assert "timeline_path" not in plain["kv_connector_extra_config"]
    # Not KvmuxConnector: no timeline key anywhere.
    assert "timeline_path" not in str(serve.system_config("host", 1.0, None, "/tmp/x"))
    assert serve.is_kvmux("kvmux-host") and not serve.is_kvmux("multi")
    with pytest.raises(ValueError):
        serve.system_config("kvmux-first-bogus", 1.0, 5555)


def test_pays_workload_keeps_reuse_on_the_tiers():
    for w in (serve.PAYS, fleet.PAYS, fleet.PAYS_QUICK):
        assert w.model == "pays"
        assert w.gpu_blocks * serve.BLOCK_SIZE < w.users * w.conversation_tokens


def _run(k: int, p50: float, p99: float, reuse: float, outputs: dict[str, Any]) -> dict[str, Any]:
    return {
        "repeat": k,
        "config": {},
        "errors": [],
        "requests": 2,
        "ttft_ms": {"p50": p50, "p90": p99, "p99": p99},
        "ttft_reuse_ms": {"p50": reuse, "p99": p99},
        "request_throughput": 1.0,
        "cross_instance": {"hit_tokens": 10 * (k + 1), "available_tokens": 40},
        "instances": [
            {"kvmux_decision_by_child": {"L": {"decisions": 2, "declined_slow_load": 32}}},
            {"kvmux_decision_by_child": {"L": {"decisions": 1, "declined_slow_load": 0}}},
        ],
        "outputs": outputs,
    }


def test_fleet_aggregates_repeats_into_paired_medians():
    same = {"0/0": [1, 2], "0/1": [3, 4]}
    other = {"0/0": [1, 2], "0/1": [3, 5]}
    shared = [
        _run(0, 200, 400, 100, same),
        _run(1, 300, 600, 90, same),
        _run(2, 90, 300, 80, other),
    ]
    alone = [
        _run(0, 100, 400, 100, same),
        _run(1, 100, 300, 100, same),
        _run(2, 100, 300, 100, same),
    ]
    empty = {"all": {"compute_s_per_token": None, "children": {}}}
    report: dict[str, Any] = {
        "systems": {
            "shared-l2-cost": {**fleet._aggregate("shared-l2-cost", shared), "breakdown": empty},
            "l1-only": {**fleet._aggregate("l1-only", alone), "breakdown": empty},
        }
    }
    agg = report["systems"]["shared-l2-cost"]
    assert agg["ttft_ms"]["p50"] == 200 and agg["cross_instance_hit_tokens"] == [10, 20, 30]
    assert agg["decisions_by_child"] == {"L": {"decisions": 9, "declined_slow_load": 96}}
    fleet._compare(report)
    r = report["ratios"]
    assert r["shared-l2-cost/l1-only ttft p50"] == 2.0  # of 2.0, 3.0, 0.9
    assert r["shared-l2-cost/l1-only ttft p99"] == 1.0  # of 1.0, 2.0, 1.0
    assert r["shared-l2-cost/l1-only reuse-round ttft p50"] == 0.9  # of 1.0, 0.9, 0.8
    assert report["ratio_repeats"]["shared-l2-cost/l1-only ttft p50"]["values"] == [2.0, 3.0, 0.9]
    # Five runs against l1-only's first; one answer of one run differs.
    assert report["outputs_match"] == {"reference": "l1-only r0", "matched": 9, "total": 10}
    assert report["cross_instance_hit_tokens"] == {"shared-l2-cost": 20, "l1-only": 20}


KV_PER_TOKEN = 8 * 1024  # SERVE_LLAMA: 8 layers x 2 KV heads x 64 x float32 x (K, V)


def test_tier_workloads_are_sized_for_their_purpose():
    """host-fits and spill make vLLM's KV cache the bottleneck (it holds
    less than the users' conversations); host-fits' host tier holds them
    all, spill's less than half (so a second tier has something to serve)."""
    for name, want in (("host-fits", "first-only"), ("spill", "second-serves")):
        for w in serve.WORKLOADS[name]:
            assert w.purpose == want
            working = w.users * w.conversation_tokens
            assert w.gpu_blocks * serve.BLOCK_SIZE < working
            host_tokens = w.host_gib * 2**30 / KV_PER_TOKEN
            if want == "first-only":
                assert host_tokens > working
            else:
                assert host_tokens < working / 2
    with pytest.raises(ValueError, match="purpose"):
        serve.ServeWorkload(purpose="everything")


def _sys(connector: int, by_child: dict[str, int] | None = None) -> dict[str, Any]:
    tok: dict[str, Any] = {"connector": connector}
    if by_child is not None:
        tok["kvmux_loaded_by_child"] = by_child
    return {"repeats": [{"repeat": 0, "tokens": tok}]}


def _purpose(purpose: str, systems: dict[str, Any]) -> dict[str, Any]:
    return serve.check_purpose({"workload": {"purpose": purpose}, "systems": systems})


def test_check_purpose_names_each_miss():
    both = {"KvmuxHostCache": 900, "LMCacheMPConnector": 0}
    ok = _purpose(
        "first-only", {"vllm": _sys(0), "host": _sys(900), "kvmux-first": _sys(900, both)}
    )
    assert ok["reached"] and ok["misses"] == []
    assert serve.format_purpose(ok) == [
        "workload purpose (first-only): reached in every system and repeat"
    ]
    # The second tier served on host-fits; the host tier alone served nothing.
    spilled = {"KvmuxHostCache": 600, "LMCacheMPConnector": 300}
    bad = _purpose("first-only", {"host": _sys(0), "kvmux-first": _sys(900, spilled)})
    assert not bad["reached"]
    assert any(m.startswith("host repeat 0: its tiers served no token") for m in bad["misses"])
    assert any("second tier served 300 tokens" in m for m in bad["misses"])
    text = serve.format_purpose(bad)
    assert text[0].startswith("WORKLOAD MISSED ITS PURPOSE (first-only)")
    # spill: the second tier must serve; the host tier alone may lose it all.
    lost = {"host": _sys(0), "kvmux-first": _sys(900, spilled)}
    assert _purpose("second-serves", lost)["reached"]
    nothing = _purpose("second-serves", {"kvmux-first": _sys(900, both)})
    assert nothing["misses"] == [
        "kvmux-first repeat 0: the second tier served no token (the host tier was meant "
        "to lose part of the working set)"
    ]
    # chat/pays ("tiers"): only that the tiers served.
    assert _purpose("tiers", {"kvmux-first": _sys(900, spilled)})["reached"]


def test_always_systems_run_vllms_behaviour():
    """``kvmux-first-always`` (and fleet's ``shared-l2-always``, through
    ``kvmux-compose-always``): every load taken and every child saving every
    request, what the defaults are compared against."""
    for name, policy in (("kvmux-first-always", "first"), ("kvmux-compose-always", "compose")):
        cfg = serve.system_config(name, 1.0, 5555)
        assert cfg is not None
        extra = cfg["kv_connector_extra_config"]
        assert extra["load_policy"] == policy and extra["load_decision"] == "always"
        assert [c["save_policy"] for c in extra["connectors"]] == ["always", "always"]
    default = serve.system_config("kvmux-first", 1.0, 5555)
    assert default is not None
    assert all("save_policy" not in c for c in default["kv_connector_extra_config"]["connectors"])
    assert "kvmux-first-always" in serve.SYSTEMS and "shared-l2-always" in fleet.SYSTEMS


def test_fleet_cross_instance_ratio_default_over_always():
    same = {"0/0": [1, 2]}
    ci = {"available_tokens": 100}
    runs = {
        n: [
            _run(k, 100, 100, 100, same) | {"cross_instance": {**ci, "hit_tokens": h}}
            for k in range(3)
        ]
        for n, h in (("shared-l2", 90), ("shared-l2-always", 100), ("l1-only", 0))
    }
    empty = {"all": {"compute_s_per_token": None, "children": {}}}
    report: dict[str, Any] = {
        "systems": {n: {**fleet._aggregate(n, r), "breakdown": empty} for n, r in runs.items()}
    }
    fleet._compare(report)
    assert report["ratios"]["shared-l2/shared-l2-always cross-instance hit tokens"] == 0.9


def test_returning_workload_and_the_lru_system():
    """``returning``: the host tier holds part of the conversations, more than
    the one or two a user waits behind (where recency is right); ``host-lru``
    is the host tier with ``eviction: lru``, ``host`` its default."""
    for w in serve.WORKLOADS["returning"]:
        working = w.users * w.conversation_tokens
        assert w.gpu_blocks * serve.BLOCK_SIZE < working
        host_tokens = w.host_gib * 2**30 / KV_PER_TOKEN
        assert w.conversation_tokens < host_tokens < working
    lru = serve.system_config("host-lru", 1.0, None)
    assert lru is not None and lru["kv_connector_extra_config"]["eviction"] == "lru"
    host = serve.system_config("host", 1.0, None)
    assert host is not None and "eviction" not in host["kv_connector_extra_config"]
