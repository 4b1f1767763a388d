"""An abort must never take the engine down: a child failing on a request it
never took part in is contained; one that took part still fails named.
vLLM's real scheduler; the children are scripted (``tests/support/scripted.py``),
standing in for a child such as LMCache's that cannot finish a request it
has never seen (``tests/mux/test_lmcache.py`` shows it with the real one)."""

from __future__ import annotations

import logging

import pytest
from vllm.v1.request import RequestStatus

from kvmux import KvmuxChildError
from tests.support.harness import mux_config, scripted

PROMPT = list(range(100, 164))
ASK = {"num_extra_cached_tokens": True}


def capture_finishes(d) -> list:
    """What kvmux's finish hook returns to vLLM, as vLLM receives it."""
    got: list = []
    real = d.connector.request_finished_all_groups

    def spy(request, block_ids):
        out = real(request, block_ids)
        got.append((request.request_id, out))
        return out

    d.connector.request_finished_all_groups = spy
    return got


def abort(d, req_id: str) -> None:
    d.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)


def test_a_child_failing_on_a_request_it_never_saw_is_contained(driver_factory, caplog):
    """Aborted while waiting, before any lookup: the failing child counts as
    "no async save, no params"; the other child's params and kvmux's own are
    returned, the failure is logged once per child and counted, nothing is
    left behind, and the next request is served as usual."""
    d = driver_factory(
        mux_config([scripted(fail="request_finished", async_save=True), scripted(params={"y": 2})])
    )
    got = capture_finishes(d)
    d.add("C1", PROMPT, kv_transfer_params=ASK)
    d.add("C2", PROMPT, kv_transfer_params=ASK)
    with caplog.at_level(logging.DEBUG, logger="kvmux"):
        abort(d, "C1")
        abort(d, "C2")
    assert got == [
        ("C1", (False, {"y": 2, "num_extra_cached_tokens": 0})),
        ("C2", (False, {"y": 2, "num_extra_cached_tokens": 0})),
    ]
    mine = [r for r in caplog.records if r.name == "kvmux"]
    warnings = [r for r in mine if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'ScriptedConnector#0'" in warnings[0].getMessage()
    assert "'C1'" in warnings[0].getMessage()
    assert "request_finished" in warnings[0].getMessage()
    assert any("'C2'" in r.getMessage() for r in mine if r.levelno == logging.DEBUG)
    stats = d.connector.mux_stats()
    assert stats["children"]["ScriptedConnector#0"]["contained_errors"] == 2
    assert stats["children"]["ScriptedConnector#1"]["contained_errors"] == 0
    assert d.connector.num_live_requests() == 0
    # The failing child's worker reports every finished request as saved (as
    # LMCache's does); vLLM freed C1 and C2 already, so kvmux drops that.
    d.connector.children[0].script["fail"] = None
    d.add("R", PROMPT, kv_transfer_params=ASK)
    d.run()
    assert d.outputs["R"] == [7] * 4
    assert d.finished_sending == ["R"]
    assert d.worker.num_pending_async_saves() == 0


def test_a_child_failing_on_a_request_it_took_part_in_still_fails_named(driver_factory):
    """Looked up, then aborted: the child's error reaches vLLM with its name,
    after every other child was told the request finished."""
    d = driver_factory(mux_config([scripted(fail="request_finished"), scripted(not_ready=100)]))
    d.add("R", PROMPT, kv_transfer_params=ASK)
    d.step()  # both children looked it up; the second is not ready yet
    with pytest.raises(KvmuxChildError) as err:
        abort(d, "R")
    assert err.value.child == "ScriptedConnector#0"
    assert err.value.hook == "request_finished"
    assert ("finished", "R") in d.connector.children[1].calls
    assert d.connector.num_live_requests() == 0
    assert d.connector.mux_stats()["children"]["ScriptedConnector#0"]["contained_errors"] == 0


def test_partial_tail_registration_is_contained_the_same_way(driver_factory):
    """``register_finished_partial_tail`` is the other hook on a request's way
    out (vLLM calls it before the finish hook when it has tails to hand over)."""
    d = driver_factory(
        mux_config([scripted(fail="register_finished_partial_tail"), scripted(partial_tail=True)])
    )
    waiting = d.add("W", PROMPT)
    assert d.connector.register_finished_partial_tail(waiting, ([],), [(0, 1, 16)]) is True
    assert d.connector.mux_stats()["children"]["ScriptedConnector#0"]["contained_errors"] == 1
    d.step()
    looked_up = d.scheduler.requests["W"]
    with pytest.raises(KvmuxChildError, match="register_finished_partial_tail"):
        d.connector.register_finished_partial_tail(looked_up, ([],), [(0, 1, 16)])
