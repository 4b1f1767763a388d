"""Lookup deadlines: a child still answering a request's lookup "not ready"
past its ``lookup_timeout_ms`` is a miss for that request, driven through
vLLM's real v1 ``Scheduler`` (the rule: ``SchedulerMux::lookup`` in
``rust/mux/scheduler/lookup.rs``).
"""

from __future__ import annotations

import time

import pytest
from vllm.v1.request import RequestStatus

from kvmux import KvmuxConfigError, KvmuxConnector
from kvmux.mux.config import parse_mux_config
from tests.support.harness import mux_config, scripted

PROMPT = list(range(100, 164))  # 64 tokens: 4 full blocks
SLOW = 10**6  # "not ready" this many times: a child that never answers


def slow(**entry):
    """A child that always answers "not ready" (it would offer 64 tokens)."""
    return {**scripted(matched=64, not_ready=SLOW), **entry}


def until_scheduled(d, req_id, within_s):
    """Step until ``req_id`` is scheduled: (its scheduler output, seconds)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        so = d.step()
        if req_id in so.num_scheduled_tokens:
            return so, time.monotonic() - t0
        time.sleep(0.005)
    return None, time.monotonic() - t0


def test_a_child_past_its_deadline_no_longer_holds_the_request(driver_factory):
    d = driver_factory(mux_config([slow(lookup_timeout_ms=100), scripted(matched=32)]))
    d.add("r", PROMPT, kv_transfer_params={"num_extra_cached_tokens": True})
    so, waited = until_scheduled(d, "r", within_s=10)
    assert so is not None, "the request still waits for the slow child"
    assert 0.1 <= waited < 5
    assert so.num_scheduled_tokens["r"] == len(PROMPT) - 32  # the other child loads
    slow_child = d.connector.children[0]
    asked = slow_child.calls.count(("lookup", "r"))
    d.run()
    assert d.finished["r"] == {"num_extra_cached_tokens": 32}
    # Not asked again once late; still told of the allocation and the finish,
    # so it releases what it reserved through its normal path.
    assert slow_child.calls.count(("lookup", "r")) == asked
    assert ("alloc", ("r", 0)) in slow_child.calls
    assert ("finished", "r") in slow_child.calls
    assert d.connector.mux_stats()["children"]["ScriptedConnector#0"]["lookup_timeouts"] == 1
    assert d.connector.num_live_requests() == 0


def test_without_a_deadline_the_same_child_holds_the_request(driver_factory):
    d = driver_factory(mux_config([slow(), scripted(matched=32)]))
    d.add("r", PROMPT)
    so, _ = until_scheduled(d, "r", within_s=0.5)
    assert so is None
    assert d.connector.mux_stats()["children"]["ScriptedConnector#0"]["lookup_timeouts"] == 0
    d.scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert d.connector.num_live_requests() == 0


def test_the_global_deadline_holds_for_children_without_their_own(driver_factory):
    d = driver_factory(mux_config([slow(), scripted()], lookup_timeout_ms=50))
    d.add("r", PROMPT)
    so, waited = until_scheduled(d, "r", within_s=10)
    assert so is not None and waited >= 0.05
    assert so.num_scheduled_tokens["r"] == len(PROMPT)  # nobody had it: computed locally
    d.run()
    # A child's own entry wins, None included: this one may take for ever.
    d = driver_factory(mux_config([slow(lookup_timeout_ms=None), scripted()], lookup_timeout_ms=50))
    d.add("r", PROMPT)
    assert until_scheduled(d, "r", within_s=0.5)[0] is None
    d.scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)


@pytest.mark.parametrize("value", [0, -5, "2s", True, float("nan")])
@pytest.mark.parametrize("where", ["global", "child"])
def test_a_bad_deadline_is_refused_with_the_fix(value, where):
    if where == "global":
        ktc = mux_config([scripted()], lookup_timeout_ms=value)
    else:
        ktc = mux_config([{**scripted(), "lookup_timeout_ms": value}])
    with pytest.raises(KvmuxConfigError) as err:
        KvmuxConnector.validate_transfer_config(ktc)
    text = str(err.value)
    assert f"lookup_timeout_ms={value!r}" in text and "milliseconds" in text
    if where == "child":
        assert "connectors[0]" in text


def test_the_deadline_is_not_a_key_of_the_childs_own_config():
    """kvmux takes ``lookup_timeout_ms`` out of the child's entry (vLLM's
    ``KVTransferConfig`` refuses unknown fields) and keeps it as the child's."""
    spec = parse_mux_config(mux_config([{**scripted(), "lookup_timeout_ms": 250}])).children[0]
    assert spec.lookup_timeout_ms == 250.0
    assert not hasattr(spec.transfer_config, "lookup_timeout_ms")
    assert parse_mux_config(mux_config([scripted()])).children[0].lookup_timeout_ms is None


def test_doctor_shows_each_childs_deadline():
    import json
    import subprocess
    import sys

    cfg = {
        "kv_connector": "KvmuxConnector",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [{**scripted(), "lookup_timeout_ms": 250}, scripted()],
        },
    }
    proc = subprocess.run(
        [sys.executable, "-m", "kvmux", "doctor", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "child ScriptedConnector" in line]
    assert "a miss after 250 ms not ready" in lines[0]
    assert "ms not ready" not in lines[1]
