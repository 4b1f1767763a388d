"""The circuit breaker per child, driven through vLLM's real v1 ``Scheduler``
(the rules: ``rust/mux/breaker.rs`` and ``SchedulerMux::lookup`` in
``rust/mux/scheduler/lookup.rs``).

A child that keeps failing its lookups (missing its ``lookup_timeout_ms``, or
raising) is not asked for a cooldown, then probed by one request. The
failing children are ``tests/support/scripted.py`` connectors told to raise or to
answer "not ready": stand-ins for a cache server that is down or slow (the
real LMCache server stopped: ``tests/mux/test_lmcache_outage.py``)."""

from __future__ import annotations

import itertools
import logging
import time

import pytest
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

from kvmux import KvmuxConfigError, KvmuxConnector
from kvmux.mux.config import BreakerSpec, parse_mux_config
from kvmux.mux.stats import KvmuxStats
from tests.support.harness import mux_config, scripted

# vLLM's load rule on the simulator: see conftest.
pytestmark = pytest.mark.usefixtures("vllms_load_rule")

PROMPT = list(range(100, 164))  # 64 tokens: 4 full blocks
FLAKY = "ScriptedConnector#0"


def flaky(**entry):
    """A child whose lookups raise (it would offer 64 tokens otherwise)."""
    return {**scripted(matched=64, fail="get_num_new_matched_tokens"), **entry}


_PROMPTS = itertools.count(1)


def serve(d, req_id, within_s=5.0):
    """Add a request (a prompt no earlier request shares, so vLLM's own
    prefix cache never serves it) and run until it finished; its params."""
    start = 1000 * next(_PROMPTS)
    prompt = list(range(start, start + 64))
    d.add(req_id, prompt, kv_transfer_params={"num_extra_cached_tokens": True})
    d.run(max_steps=10**6, timeout_s=within_s)
    return d.finished[req_id]


def breaker(d, name=FLAKY):
    return d.connector.mux_stats()["breakers"].get(name)


def counters(d, name=FLAKY):
    return d.connector.mux_stats()["children"][name]


def breaker_logs(caplog):
    return [r.getMessage() for r in caplog.records if "breaker of child" in r.getMessage()]


def test_a_raising_lookup_is_a_logged_miss_and_the_request_goes_on(driver_factory, caplog):
    d = driver_factory(mux_config([flaky(), scripted(matched=32)]))
    with caplog.at_level(logging.DEBUG, logger="kvmux"):
        assert serve(d, "a") == {"num_extra_cached_tokens": 32}  # the other child loads
        assert serve(d, "b") == {"num_extra_cached_tokens": 32}
    warned = [r for r in caplog.records if "contained as a miss" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING, logging.DEBUG], "loud once per child"
    assert FLAKY in warned[0].getMessage() and "scripted failure" in warned[0].getMessage()
    assert counters(d)["lookup_errors"] == 2
    assert breaker(d) == "closed", "2 failures of the default 3"
    child = d.connector.children[0]
    # Still told of the allocation (0 tokens) and the finish.
    assert ("alloc", ("a", 0)) in child.calls and ("finished", "a") in child.calls
    assert d.connector.num_live_requests() == 0


def test_consecutive_failures_open_the_breaker_then_a_probe_closes_it(driver_factory, caplog):
    d = driver_factory(mux_config([flaky(breaker_cooldown_ms=150), scripted(matched=32)]))
    child = d.connector.children[0]
    with caplog.at_level(logging.INFO, logger="kvmux"):
        for r in ["a", "b", "c"]:
            serve(d, r)
        assert breaker(d) == "open"
        assert counters(d)["breaker_opens"] == 1
        # While open the child holds no request: it is told of a new one
        # once (LMCache's connector keeps per-request state from its lookup
        # and fails without it), its answer ignored, and keeps its
        # bookkeeping (allocation with 0 tokens, finish).
        asked = sum(1 for c in child.calls if c[0] == "lookup")
        child.script.pop("fail")  # the server is back
        assert serve(d, "d") == {"num_extra_cached_tokens": 32}, "its 63 tokens ignored"
        assert sum(1 for c in child.calls if c[0] == "lookup") == asked + 1
        assert ("alloc", ("d", 0)) in child.calls and ("finished", "d") in child.calls
        assert counters(d)["breaker_skips"] == 1
        # After the cooldown, the next request probes it and it serves again.
        time.sleep(0.2)
        assert serve(d, "e") == {"num_extra_cached_tokens": 63}  # all but the last token
        assert breaker(d) == "closed"
    logs = breaker_logs(caplog)
    assert len(logs) == 3, logs  # each transition logged once
    assert "opened after 3 failed lookup(s)" in logs[0] and "0.1 s" in logs[0]
    assert "half open: request 'e' probes it" in logs[1]
    assert "closed" in logs[2]
    assert d.connector.num_live_requests() == 0


def test_a_child_past_its_deadline_opens_its_breaker_and_stops_holding_requests(
    driver_factory,
):
    slow = {**scripted(matched=64, not_ready=10**6), "lookup_timeout_ms": 100}
    d = driver_factory(mux_config([slow, scripted(matched=32)], breaker_failures=2))
    for r in ["a", "b"]:
        t0 = time.monotonic()
        serve(d, r)
        assert time.monotonic() - t0 >= 0.1, "each waits out the deadline"
    assert breaker(d) == "open" and counters(d)["lookup_timeouts"] == 2
    t0 = time.monotonic()
    assert serve(d, "c") == {"num_extra_cached_tokens": 32}
    assert time.monotonic() - t0 < 0.1, "an open breaker does not wait for the deadline"
    assert d.connector.num_live_requests() == 0


def test_an_open_breaker_frees_the_requests_already_waiting_on_the_child(driver_factory):
    """A request whose lookup is in flight when the breaker opens does not
    wait out its own deadline."""
    slow = {**scripted(matched=64, not_ready=10**6), "lookup_timeout_ms": 300}
    d = driver_factory(mux_config([slow, scripted()], breaker_failures=1))
    d.add("w1", PROMPT)
    assert not d.step().num_scheduled_tokens
    time.sleep(0.2)
    d.add("w2", list(range(200, 264)))
    assert not d.step().num_scheduled_tokens  # both wait on the slow child
    time.sleep(0.15)  # w1 is past its deadline, w2 is not
    so = d.step()
    assert set(so.num_scheduled_tokens) == {"w1", "w2"}
    assert counters(d)["lookup_timeouts"] == 1 and counters(d)["breaker_skips"] == 1
    d.run(timeout_s=5)
    assert d.connector.num_live_requests() == 0


def test_with_the_breaker_off_a_raising_lookup_fails_loudly(driver_factory):
    from kvmux import KvmuxChildError

    d = driver_factory(mux_config([flaky(breaker_failures=None), scripted()]))
    d.add("a", PROMPT)
    with pytest.raises(KvmuxChildError, match="get_num_new_matched_tokens"):
        d.run()
    assert d.connector.mux_stats()["breakers"] == {"ScriptedConnector#1": "closed"}


def test_the_breaker_state_reaches_prometheus_as_a_gauge(driver_factory):
    d = driver_factory(mux_config([flaky(breaker_failures=1), scripted()]))
    serve(d, "a")
    seen = KvmuxStats()
    for payload in d.kv_stats:
        seen.aggregate(KvmuxStats.rebuild(payload))
    assert seen.counters["breaker_state"][FLAKY] == 2  # open
    prom = KVConnectorProm(d.vllm_config, ["model_name", "engine"], {0: ["tiny", 0]})
    for payload in d.kv_stats:
        prom.observe(payload, engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0", "connector": FLAKY}
    assert REGISTRY.get_sample_value("kvmux_breaker_state", labels) == 2.0
    assert REGISTRY.get_sample_value("kvmux_breaker_opens_total", labels) >= 1


def test_a_later_state_replaces_an_earlier_one_on_aggregation():
    a = KvmuxStats.rebuild({"kvmux": {"breaker_state": {"x": 2}}})
    a.aggregate(KvmuxStats.rebuild({"kvmux": {"breaker_state": {"x": 0}}}))
    assert a.counters["breaker_state"] == {"x": 0}


def test_breaker_settings_global_per_child_and_off():
    cfg = parse_mux_config(
        mux_config(
            [
                scripted(),
                {**scripted(), "breaker_failures": 5, "breaker_cooldown_ms": 200},
                {**scripted(), "breaker_failures": None},
            ],
            breaker_cooldown_ms=50,
            breaker_max_cooldown_ms=400,
        )
    )
    got = [c.breaker for c in cfg.children]
    assert got == [
        BreakerSpec(failures=3, cooldown_ms=50.0, max_cooldown_ms=400.0),
        BreakerSpec(failures=5, cooldown_ms=200.0, max_cooldown_ms=400.0),
        None,
    ]
    assert not hasattr(cfg.children[1].transfer_config, "breaker_failures")
    off = parse_mux_config(mux_config([scripted()], breaker_failures=None))
    assert off.children[0].breaker is None
    # A first cooldown above the default longest one raises the longest.
    long = parse_mux_config(mux_config([scripted()], breaker_cooldown_ms=60000))
    assert long.children[0].breaker.max_cooldown_ms == 60000.0


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("breaker_failures", 0, "an int >= 1"),
        ("breaker_failures", 2.5, "an int >= 1"),
        ("breaker_failures", True, "an int >= 1"),
        ("breaker_cooldown_ms", 0, "milliseconds of at least 1"),
        ("breaker_cooldown_ms", "1s", "milliseconds of at least 1"),
        ("breaker_max_cooldown_ms", -1, "milliseconds of at least 1"),
    ],
)
@pytest.mark.parametrize("where", ["global", "child"])
def test_bad_breaker_settings_are_refused_with_the_fix(key, value, words, where):
    if where == "global":
        ktc = mux_config([scripted()], **{key: value})
    else:
        ktc = mux_config([{**scripted(), key: value}])
    with pytest.raises(KvmuxConfigError) as err:
        KvmuxConnector.validate_transfer_config(ktc)
    text = str(err.value)
    assert f"{key}={value!r}" in text and words in text
    if where == "child":
        assert "connectors[0]" in text


def test_a_longest_cooldown_below_the_first_is_refused():
    ktc = mux_config([scripted()], breaker_cooldown_ms=500, breaker_max_cooldown_ms=100)
    with pytest.raises(KvmuxConfigError, match="the longest cooldown is at least the first"):
        KvmuxConnector.validate_transfer_config(ktc)


def test_doctor_shows_a_breaker_that_is_not_the_default():
    import json
    import subprocess
    import sys

    cfg = {
        "kv_connector": "KvmuxConnector",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {**scripted(), "breaker_failures": 5},
                {**scripted(), "breaker_failures": None},
                scripted(),
            ],
        },
    }
    proc = subprocess.run(
        [sys.executable, "-m", "kvmux", "doctor", json.dumps(cfg)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "child ScriptedConnector" in line]
    assert "breaker: open after 5 failed lookups for 1000-30000 ms" in lines[0]
    assert "no breaker" in lines[1]
    assert "breaker" not in lines[2], "the default is not repeated"
