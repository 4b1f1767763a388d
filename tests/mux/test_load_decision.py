"""``load_decision: "cost"`` and ``timeline_path``, driven through vLLM's
real v1 ``Scheduler`` (the rule and the estimator: ``rust/mux/cost.rs``,
applied in ``rust/mux/scheduler/decision.rs``; their own cargo tests cover a
child that turns slow and one that recovers).

The scheduler simulation's model is a stand-in (no GPU, no real forward):
an engine step takes what this process takes to run it, so computing a
prompt token here costs next to nothing, and the decision learns exactly
that. The tests below rely on it: on this "engine" a child that keeps a
request waiting is never worth waiting for.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

from kvmux import KvmuxConfigError
from kvmux.mux.config import parse_mux_config
from kvmux.mux.stats import KvmuxStats
from tests.support.harness import mux_config, scripted

PROMPT = list(range(100, 164))  # 64 tokens: 4 full blocks
NEVER = 10**6  # "not ready" this many times: a child that never answers


def warm_up(d, n=4):
    """Run a few requests to the end, so the engine's steps are measured
    (every child ready meanwhile)."""
    scripts = [c.script for c in d.connector.children]
    held = [s.get("not_ready", 0) for s in scripts]
    for s in scripts:
        s["not_ready"] = 0
    for k in range(n):
        d.add(f"warm{k}", [7 + k] * 48 + list(range(300, 316)))
    d.run()
    for s, n_ready in zip(scripts, held, strict=True):
        s["not_ready"] = n_ready


def until_scheduled(d, req_id, within_s):
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        so = d.step()
        if req_id in so.num_scheduled_tokens:
            return so
        time.sleep(0.002)
    return None


def test_an_unknown_decision_or_a_bad_timeline_path_is_refused_with_the_fix(tmp_path):
    with pytest.raises(KvmuxConfigError) as e:
        parse_mux_config(mux_config([scripted()], load_decision="costs"))
    msg = str(e.value)
    assert "load_decision='costs'" in msg and "did you mean 'cost'" in msg
    assert "['always', 'cost']" in msg
    with pytest.raises(KvmuxConfigError, match="does not exist; create it"):
        parse_mux_config(mux_config([scripted()], timeline_path=str(tmp_path / "no" / "t.jsonl")))
    with pytest.raises(KvmuxConfigError, match="is a directory"):
        parse_mux_config(mux_config([scripted()], timeline_path=str(tmp_path)))
    with pytest.raises(KvmuxConfigError, match="must be a file path"):
        parse_mux_config(mux_config([scripted()], timeline_path=3))
    cfg = parse_mux_config(mux_config([scripted()]))
    assert (cfg.load_decision, cfg.timeline_path) == ("always", None), "vLLM's rule by default"


def test_a_child_that_never_gets_ready_no_longer_holds_the_request(driver_factory, tmp_path):
    """Without a lookup_timeout_ms: once computing the prompt is measured to
    be faster than the wait, the request is computed, and the child is not
    asked again for it."""
    path = tmp_path / "t.jsonl"
    cfg = mux_config(
        [scripted(matched=64, not_ready=NEVER), scripted(matched=0)],
        load_decision="cost",
        timeline_path=str(path),
    )
    d = driver_factory(cfg)
    warm_up(d)
    d.add("r", PROMPT)
    so = until_scheduled(d, "r", within_s=10)
    assert so is not None, "the request still waits for a child that never answers"
    assert so.num_scheduled_tokens["r"] == len(PROMPT)  # computed
    slow = d.connector.children[0]
    asked = slow.calls.count(("lookup", "r"))
    d.run()
    assert slow.calls.count(("lookup", "r")) == asked
    assert ("finished", "r") in slow.calls  # still told, to release its state
    stats = d.connector.mux_stats()["children"]["ScriptedConnector#0"]
    assert stats["declined_slow_wait_tokens"] >= len(PROMPT) - 1
    assert stats["load_decisions"] >= 1
    assert d.connector.num_live_requests() == 0
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    (r,) = [
        x
        for x in lines
        if x["prompt_tokens"] == len(PROMPT)
        and x["external_tokens"] == 0
        and x["children"][0]["declined"]
    ]
    assert r["children"][0]["declined"] == "slow_wait"
    assert r["lookup_calls"] >= 1


def test_with_the_decision_off_the_same_child_holds_the_request(driver_factory):
    cfg = mux_config([scripted(matched=64, not_ready=NEVER), scripted()], load_decision="always")
    d = driver_factory(cfg)
    warm_up(d)
    d.add("r", PROMPT)
    assert until_scheduled(d, "r", within_s=0.5) is None
    stats = d.connector.mux_stats()["children"]["ScriptedConnector#0"]
    assert stats["load_decisions"] == 0 and stats["declined_slow_wait_tokens"] == 0


def test_the_timeline_says_where_each_requests_time_went(driver_factory, tmp_path):
    path = tmp_path / "timeline.jsonl"
    cfg = mux_config(
        [scripted(matched=0), scripted(matched=48, load_async=True, not_ready=2)],
        timeline_path=str(path),
    )
    d = driver_factory(cfg)
    d.add("r", PROMPT)
    d.run()
    (t,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert t["req_id"] == "r" and t["prompt_tokens"] == len(PROMPT)
    assert [c["name"] for c in t["children"]] == ["ScriptedConnector#0", "ScriptedConnector#1"]
    slow = t["children"][1]
    assert slow["not_ready"] == 2 and t["lookup_calls"] == 3
    assert slow["tokens"] == 48 and slow["load_tokens"] == 48 and slow["load_async"]
    assert slow["declined"] is None
    assert t["external_tokens"] == 48
    # In order: arrival, lookups, the ready answer, allocation, the load's
    # end, the step computing the last prompt token, the finish.
    order = [
        t["arrival"],
        t["first_lookup"],
        t["ready"],
        t["allocated"],
        slow["load_start"],
        slow["load_done"],
        t["first_token"],
        t["finished"],
    ]
    assert None not in order
    assert order == sorted(order), order
    assert 0 <= slow["not_ready_s"] <= t["ready"] - t["first_lookup"] + 1e-6
    assert t["children"][0]["load_tokens"] == 0 and t["children"][0]["load_start"] is None


def test_a_rotated_timeline_file_is_followed(driver_factory, tmp_path):
    """logrotate moves the file away: the next finished request's line goes
    to a new file at timeline_path, the earlier ones stay in the moved one."""
    path = tmp_path / "timeline.jsonl"
    d = driver_factory(mux_config([scripted(matched=0)], timeline_path=str(path)))
    d.add("before", PROMPT)
    d.run()
    path.rename(tmp_path / "timeline.jsonl.1")
    d.add("after", [9] * 64)
    d.run()

    def ids(p):
        return [json.loads(x)["req_id"] for x in p.read_text().splitlines()]

    assert (ids(tmp_path / "timeline.jsonl.1"), ids(path)) == (["before"], ["after"])


def test_a_timeline_that_cannot_be_written_never_stops_serving(driver_factory, tmp_path, caplog):
    """The directory disappears under a running server: requests still
    finish (every child told, nothing left live), a warning says what and
    how to fix it, and once the directory is back the lines flow again."""
    folder = tmp_path / "logs"
    folder.mkdir()
    path = folder / "timeline.jsonl"
    d = driver_factory(mux_config([scripted(matched=0)], timeline_path=str(path)))
    d.add("first", PROMPT)
    d.run()
    path.unlink()
    folder.rmdir()
    with caplog.at_level(logging.WARNING, logger="kvmux"):
        for k in range(2):
            d.add(f"lost{k}", [5 + k] * 64)
            d.run()
        child = d.connector.children[0]
        assert ("finished", "lost0") in child.calls and ("finished", "lost1") in child.calls
        assert d.connector.num_live_requests() == 0
        failed = [r.getMessage() for r in caplog.records if "cannot append" in r.getMessage()]
        assert len(failed) == 1, failed  # once, not per request
        assert str(path) in failed[0] and "Fix:" in failed[0]
        folder.mkdir()
        d.add("back", [8] * 64)
        d.run()
    assert [json.loads(x)["req_id"] for x in path.read_text().splitlines()] == ["back"]
    assert any("2 timelines were dropped" in r.getMessage() for r in caplog.records)


def test_what_the_decision_learned_is_in_mux_stats_and_prometheus(driver_factory):
    """An operator sees why spans are declined: the engine's compute per
    token and each child's load and not-ready wait, as the decision has
    learned them, in mux_stats() and as Prometheus gauges."""
    cfg = mux_config(
        [scripted(matched=0), scripted(matched=48, load_async=True, not_ready=1)],
        load_decision="cost",
    )
    d = driver_factory(cfg)
    for k in range(5):
        d.add(f"r{k}", [20 + k] * 48 + list(range(400, 416)))
        d.run()
    learned = d.connector.mux_stats()["load_decision"]
    assert learned["compute_s_per_token"] > 0
    slow = learned["children"]["ScriptedConnector#1"]
    assert slow["load_s"] + slow["load_s_per_token"] * 48 > 0
    assert slow["not_ready_wait_s"] > 0
    assert "ScriptedConnector#0" not in learned["children"]  # never loaded nor waited for
    # The same values reach vLLM's stats (gauges: the latest report wins,
    # never summed over reports) and Prometheus.
    seen = KvmuxStats()
    reports = [p for p in d.kv_stats if (p.get("kvmux") or {}).get("load_decision")]
    assert reports
    for payload in d.kv_stats:
        seen.aggregate(KvmuxStats.rebuild(payload))
    last = reports[-1]["kvmux"]["load_decision"]
    assert seen.counters["load_decision"] == last
    prom = KVConnectorProm(d.vllm_config, ["model_name", "engine"], {0: ["tiny", 0]})
    for payload in d.kv_stats:
        prom.observe(payload, engine_idx=0)
    engine = {"model_name": "tiny", "engine": "0"}
    sample = REGISTRY.get_sample_value
    assert sample("kvmux_load_decision_compute_seconds_per_token", engine) == pytest.approx(
        last["compute_s_per_token"]
    )
    child = {**engine, "connector": "ScriptedConnector#1"}
    for key, name in [
        ("load_s_per_token", "kvmux_load_decision_load_seconds_per_token"),
        ("not_ready_wait_s", "kvmux_load_decision_not_ready_wait_seconds"),
    ]:
        assert sample(name, child) == pytest.approx(last["children"]["ScriptedConnector#1"][key])


def test_with_the_decision_off_and_no_timeline_nothing_is_learned(driver_factory):
    d = driver_factory(mux_config([scripted(matched=48, load_async=True)], load_decision="always"))
    d.add("r", PROMPT)
    d.run()
    assert "load_decision" not in d.connector.mux_stats()
    assert not any((p.get("kvmux") or {}).get("load_decision") for p in d.kv_stats)
