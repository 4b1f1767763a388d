"""Completions with a child's identity, through vLLM's real v1 ``Scheduler``
and worker-side connectors (``tests/support/harness.py``; the rules:
``rust/mux/completions.rs``).

vLLM trusts every "finished sending" / "finished receiving" id a connector
reports: a duplicate or a stale one corrupts its bookkeeping or crashes the
scheduler (vllm#53049, vllm-ascend#14407). The misbehaving children are
``tests/support/scripted.py`` connectors told to repeat their completions or to
report requests they never saved (as LMCache's workers do): stand-ins for
third-party connectors with those bugs."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from kvmux import KvmuxConnector
from tests.support.harness import mux_config, scripted

# A later child must save what it sees once (vLLM's rule): see conftest.
pytestmark = pytest.mark.usefixtures("every_child_saves")

_PROMPTS = itertools.count(1)


def prompt():
    start = 1000 * next(_PROMPTS)
    return list(range(start, start + 40))


def worker_counters(d, child):
    """The workers' per-child counters, as the front end accumulates them."""
    acc = KvmuxConnector.build_kv_connector_stats(None)
    for payload in d.kv_stats:
        acc = acc.aggregate(KvmuxConnector.build_kv_connector_stats(payload))
    return acc.counters.get("children", {}).get(child, {})


def test_a_request_is_finished_sending_once_after_every_saver_and_duplicates_drop(
    driver_factory,
):
    d = driver_factory(
        mux_config(
            [
                scripted(async_save=True, repeat_completions=True),
                scripted(async_save=True, hold=["r"]),
            ]
        )
    )
    d.add("r", prompt())
    while "r" not in d.finished:
        d.step()
    held = d.worker.children[1]
    assert d.connector.children[0].calls.count(("finished", "r")) == 1
    assert d.finished_sending == [], "child 1 still saves"
    for _ in range(3):  # child 0 reported it, then again: a duplicate
        d.step()
    assert d.finished_sending == []
    held.script["hold"] = []
    for _ in range(3):
        d.step()
    assert Counter(d.finished_sending) == {"r": 1}, "reported once, after both"
    assert "r" not in d.scheduler.requests
    c0 = worker_counters(d, "ScriptedConnector#0")
    assert c0["save_completions"] == 1 and c0["stray_completions"] == 1
    assert worker_counters(d, "ScriptedConnector#1")["save_completions"] == 1
    assert d.worker.num_pending_async_saves() == 0


def test_completions_of_requests_a_child_never_saved_never_reach_vllm(driver_factory):
    """A child whose workers report every finished request (LMCache's do)
    beside one that saves: vLLM hears only of the saved requests, each once."""
    d = driver_factory(mux_config([scripted(async_save=True), scripted(report_all_finished=True)]))
    for r in ["a", "b", "c"]:
        d.add(r, prompt())
    d.run()
    for _ in range(3):
        d.step()
    assert Counter(d.finished_sending) == {"a": 1, "b": 1, "c": 1}
    assert worker_counters(d, "ScriptedConnector#1")["stray_completions"] == 3
    assert worker_counters(d, "ScriptedConnector#0")["save_completions"] == 3
    assert d.worker.num_pending_async_saves() == 0
    assert d.connector.num_live_requests() == 0


def test_an_async_load_is_finished_by_its_loading_child_only(driver_factory):
    d = driver_factory(
        mux_config(
            [
                scripted(),
                scripted(matched=32, load_async=True, repeat_completions=True),
            ]
        )
    )
    d.add("r", prompt())
    d.run()
    assert "r" in d.finished
    assert d.outputs["r"], "the request ran once its load was reported"
    c1 = worker_counters(d, "ScriptedConnector#1")
    assert c1["load_completions"] == 1
    assert c1["stray_completions"] == 1, "the repeated receive is dropped"
    assert d.worker.num_pending_async_loads() == 0
    assert d.connector.num_live_requests() == 0
