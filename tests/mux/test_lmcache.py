"""kvmux with the real LMCache as a child: vLLM's real v1 ``Scheduler`` and
the worker side (real CPU tensors as the paged KV cache) drive
``KvmuxConnector`` over LMCache's ``LMCacheMPConnector``, talking to a real
LMCache MP server on loopback (``tests/support/lmcache_server.py``), and
``KvmuxHostCache``. The model is the one stand-in (``tests.support.harness``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.request import RequestStatus

from kvmux import KvmuxChildError
from tests.support.harness import SchedulerSim, mux_config, upstream_config
from tests.support.lmcache_server import time_limit

# On a vLLM where kvmux refuses LMCache at start-up (lmcache 0.5.6 on 0.34),
# skipped with the refusal: tests/mux/test_lmcache_vllm034.py tests that instead.
# A later child must save what it sees once, and hits load (vLLM's rules): see
# conftest.
pytestmark = pytest.mark.usefixtures("lmcache_runs", "every_child_saves", "vllms_load_rule")

PREFIX = list(range(300, 348))  # 48 tokens: 3 vLLM blocks = 3 LMCache chunks
ASK = {"cached_token_stats": True, "num_extra_cached_tokens": True}
LM, HOST = "LMCacheMPConnector", "KvmuxHostCache"


def host_child(num_blocks: int = 64) -> dict:
    return {
        "kv_connector": HOST,
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_blocks": num_blocks},
    }


@pytest.fixture
def make_sim(model_dir):
    """Build sims (their model folder, hence LMCache model name, is this
    test's own) and shut their connectors down at the end of the test."""
    built: list[SchedulerSim] = []

    def make(children: list[dict], failure_policy: str = "fail", **mux_extra) -> SchedulerSim:
        ktc = mux_config(children, **mux_extra)
        ktc.kv_load_failure_policy = failure_policy  # vLLM's default: "fail"
        # idle_wait_s: LMCache's lookups and loads are asynchronous; an idle
        # engine loop lets time pass between polls.
        d = SchedulerSim(ktc, model_dir=model_dir, idle_wait_s=0.02)
        built.append(d)
        return d

    yield make
    for d in built:
        d.close()


def run(d: SchedulerSim) -> None:
    with time_limit(60, "draining the scheduler"):
        d.run(max_steps=3000, timeout_s=45)


def forget_locally(d: SchedulerSim) -> None:
    """Wipe every copy of the KV outside LMCache: vLLM's prefix cache, the
    paged KV tensors and kvmux's host tier."""
    assert d.scheduler.reset_prefix_cache()
    for kv in d.kv_caches.values():
        kv.zero_()
    host = child_by_name(d, HOST)
    if host is not None:
        host.scheduler.index.clear_unpinned()


def child_by_name(d: SchedulerSim, name: str):
    names = d.connector.child_names
    return d.connector.children[names.index(name)] if name in names else None


def lm_trackers(d: SchedulerSim) -> dict:
    return child_by_name(d, LM).request_trackers


def kv_is_exact(d: SchedulerSim, req_id: str, tokens: list[int]) -> bool:
    return all(
        torch.equal(d.device_kv(req_id, layer, len(tokens)), d.expected_kv(tokens, layer))
        for layer in range(2)
    )


def store_prefix(d: SchedulerSim, req_id: str = "A", tokens: list[int] = PREFIX) -> None:
    d.add(req_id, tokens + [1, 2, 3], max_tokens=2)
    run(d)


def step_until_computed(d: SchedulerSim, req: Any, num_tokens: int) -> None:
    """Step until ``req`` has ``num_tokens`` computed (loaded from a tier or
    recomputed), the engine loop idling between polls; bounded in time."""
    with time_limit(60):
        while req.num_computed_tokens < num_tokens:
            d.step()
            d.idle()


# --------------------------------------------------------------- lookups


def test_a_request_waits_while_lmcache_has_not_answered(lmcache_server, make_sim):
    """LMCache's lookup answers None before its count: kvmux keeps the request
    waiting, so it is first scheduled with the LMCache hit already loaded,
    never computed from scratch."""
    d = make_sim([lmcache_server.child(), host_child()])
    store_prefix(d)
    forget_locally(d)
    b = d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
    first = d.step()
    assert "B" not in first.num_scheduled_tokens  # LMCache is still looking
    scheduled = []
    with time_limit(60):
        while "B" not in d.finished:
            so = d.step()
            if "B" in so.num_scheduled_tokens:
                scheduled.append((so.num_scheduled_tokens["B"], b.num_computed_tokens))
            if not so.num_scheduled_tokens:
                d.idle()
    # The first time B computes anything, the 48 LMCache tokens are already in.
    assert scheduled[0] == (5, 53)
    run(d)
    assert d.finished["B"]["num_extra_cached_tokens"] == 48


# ----------------------------------------------------- the loading child


def test_lmcache_loads_the_host_tier_is_told_zero_and_lookup_locks_are_released(
    lmcache_server, make_sim
):
    """Only LMCache has the prefix: it loads (byte-exact), the host tier is
    told 0 external tokens (pins nothing), and after the run LMCache holds no
    lookup lock: a cache clear then really empties it."""
    d = make_sim([host_child(), lmcache_server.child()])
    store_prefix(d)
    forget_locally(d)
    d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
    run(d)
    assert d.finished["B"]["num_extra_cached_tokens"] == 48
    st = d.connector.mux_stats()["children"]
    assert st[LM]["loads"] == 1 and st[LM]["load_tokens"] == 48
    assert st[HOST]["loads"] == 0
    assert child_by_name(d, HOST).index_stats()["pinned"] == 0
    assert lm_trackers(d) == {} and d.connector.num_live_requests() == 0
    assert_no_lookup_locks_left(d)


def test_the_host_tier_loads_and_lmcache_releases_its_lookup_locks(lmcache_server, make_sim):
    """Both children hold the prefix and the host tier comes first: it loads;
    LMCache, told 0 external tokens, frees the chunks its lookup locked."""
    d = make_sim([host_child(), lmcache_server.child()])
    store_prefix(d)
    assert d.scheduler.reset_prefix_cache()
    d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
    run(d)
    st = d.connector.mux_stats()["children"]
    assert st[HOST]["loads"] == 1 and st[LM]["loads"] == 0
    assert st[LM]["hit_tokens"] == 48  # LMCache had it too
    assert d.finished["B"]["num_extra_cached_tokens"] == 48
    assert_no_lookup_locks_left(d)


def assert_no_lookup_locks_left(d: SchedulerSim) -> None:
    """LMCache keeps chunks a lookup locked through a (non-forced) cache
    clear; with every lock released the clear empties it, so a new lookup
    of the prefix finds nothing."""
    assert child_by_name(d, LM).reset_cache() is True
    assert d.scheduler.reset_prefix_cache()
    before = d.connector.mux_stats()["children"][LM]
    d.add("probe", PREFIX + [4], max_tokens=1)
    run(d)
    after = d.connector.mux_stats()["children"][LM]
    assert after["lookups"] == before["lookups"] + 1
    assert after["hit_tokens"] == before["hit_tokens"]  # the prefix is gone


# ------------------------------------------------------------ round trip


def test_kv_stored_through_lmcache_comes_back_byte_exact_after_a_local_wipe(
    lmcache_server, make_sim
):
    d = make_sim([lmcache_server.child(), host_child()])
    store_prefix(d)
    forget_locally(d)
    b = d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
    step_until_computed(d, b, len(PREFIX))
    # Loaded into other blocks than A's, bit for bit, in every layer.
    assert kv_is_exact(d, "B", PREFIX)
    run(d)
    assert d.finished["B"]["num_extra_cached_tokens"] == 48


# ----------------------------------------------------------------- params


def test_lmcache_cached_token_stats_and_kvmux_extra_tokens_reach_the_request(
    lmcache_server, make_sim
):
    d = make_sim([lmcache_server.child(), host_child()])
    store_prefix(d)
    forget_locally(d)
    d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
    run(d)
    d.add("C", PREFIX + [8] * 5, kv_transfer_params=ASK)  # vLLM's own cache has it now
    run(d)
    assert d.finished["B"] == {
        "cached_token_stats": {
            "num_vllm_cached_tokens": 0,
            "num_lmcache_cached_tokens": 48,
            "num_lmcache_extra_cached_tokens": 48,
        },
        "num_extra_cached_tokens": 48,
    }
    c = d.finished["C"]
    assert c["num_extra_cached_tokens"] == 0
    assert c["cached_token_stats"]["num_vllm_cached_tokens"] == 48
    assert c["cached_token_stats"]["num_lmcache_extra_cached_tokens"] == 0
    assert d.connector.mux_stats()["clashes_raised"] == 0


# --------------------------------------------------------- load policies


@pytest.mark.parametrize(("policy", "loader", "loaded"), [("first", HOST, 32), ("longest", LM, 48)])
def test_load_policy_picks_between_host_tier_and_lmcache(
    lmcache_server, make_sim, policy, loader, loaded
):
    """The host tier (first in order) holds 2 blocks of the prefix, LMCache
    all 3: ``first`` loads from the host tier, ``longest`` from LMCache."""
    d = make_sim([host_child(), lmcache_server.child()], load_policy=policy)
    store_prefix(d, "A", PREFIX[:32])  # both children: 2 blocks
    # LMCache alone (another engine on the same server) stores the 3rd block.
    other = make_sim([lmcache_server.child()])
    store_prefix(other, "A2", PREFIX)
    assert d.scheduler.reset_prefix_cache()
    for kv in d.kv_caches.values():
        kv.zero_()
    d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
    run(d)
    st = d.connector.mux_stats()["children"]
    assert st[HOST]["hit_tokens"] == 32 and st[LM]["hit_tokens"] == 48
    assert st[loader]["loads"] == 1 and st[loader]["load_tokens"] == loaded
    assert d.finished["B"]["num_extra_cached_tokens"] == loaded


# ----------------------------------------------------------------- faults

#: Short LMCache timeouts, so a dead server is noticed within seconds.
FAST = {"lmcache.mp.mq_timeout": 2, "lmcache.mp.heartbeat_interval": 0.5}


def assert_nothing_left(d: SchedulerSim) -> None:
    assert d.connector.num_live_requests() == 0
    assert d.worker.num_pending_async_saves() == 0
    assert lm_trackers(d) == {}
    st = child_by_name(d, HOST).index_stats()
    assert st["pinned"] == 0 and st["writing"] == 0


def kill_when_a_load_is_planned(d: SchedulerSim, server) -> None:
    """Kill the server right after the scheduler plans an LMCache load, before
    the worker runs it."""
    schedule = d.scheduler.schedule
    lm = d.connector.child_names.index(LM)

    def schedule_then_kill():
        so = schedule()
        if any(m.direction == "RETRIEVE" for m in so.kv_connector_metadata.children[lm].requests):
            server.kill()
            d.scheduler.schedule = schedule
        return so

    d.scheduler.schedule = schedule_then_kill


def test_server_killed_during_a_lookup_the_request_is_computed_locally(
    own_lmcache_server, make_sim
):
    # (If the server's answer was already on its way, the lookup succeeds and
    # the load fails instead: vLLM recomputes either way.)
    d = make_sim([own_lmcache_server.child(**FAST), host_child()], failure_policy="recompute")
    store_prefix(d)
    forget_locally(d)
    tokens = PREFIX + [9] * 5
    b = d.add("B", tokens, kv_transfer_params=ASK)
    d.step()  # LMCache's lookup is under way
    own_lmcache_server.kill()
    step_until_computed(d, b, len(tokens))
    with time_limit(60):
        assert kv_is_exact(d, "B", tokens)  # computed here, nothing loaded
        d.run(max_steps=3000, timeout_s=30)
    assert d.outputs["B"] == [7, 7, 7, 7]
    assert d.finished["B"]["num_extra_cached_tokens"] == 0
    assert_nothing_left(d)


def test_server_killed_during_a_load_vllm_recomputes_through_its_load_error_path(
    own_lmcache_server, make_sim
):
    """The load was planned, then the server died: LMCache reports the blocks
    through ``get_block_ids_with_load_errors``, kvmux passes them on, vLLM
    (``kv_load_failure_policy: recompute``) recomputes them, and the failed
    tokens do not count as loaded."""
    d = make_sim([own_lmcache_server.child(**FAST), host_child()], failure_policy="recompute")
    store_prefix(d)
    forget_locally(d)
    tokens = PREFIX + [9] * 5
    b = d.add("B", tokens, kv_transfer_params=ASK)
    kill_when_a_load_is_planned(d, own_lmcache_server)
    step_until_computed(d, b, len(tokens))
    with time_limit(60):
        assert kv_is_exact(d, "B", tokens)  # recomputed: the KV tensors were zeroed
        d.run(max_steps=3000, timeout_s=30)
    assert d.worker.mux_stats()["load_failed_blocks"] == 3  # passed on to vLLM
    assert d.connector.mux_stats()["children"][LM]["loads"] == 1
    assert d.finished["B"]["num_extra_cached_tokens"] == 0
    assert d.finished["B"]["cached_token_stats"]["num_lmcache_extra_cached_tokens"] == 0
    assert_nothing_left(d)


def test_server_restarted_kvmux_recovers(own_lmcache_server, make_sim):
    server = own_lmcache_server
    d = make_sim([server.child(**FAST), host_child()])
    store_prefix(d)
    server.kill()
    d.add("during", list(range(700, 740)), max_tokens=2)  # served while it is down
    with time_limit(60):
        d.run(max_steps=3000, timeout_s=45)
    assert d.outputs["during"] == [7, 7]
    server.start()  # same port, empty cache
    lm_sched, lm_worker = child_by_name(d, LM), d.worker.children[0]
    with time_limit(60, "waiting for LMCache to see the server again"):
        while not (lm_sched.scheduler_adapter.is_healthy and lm_worker.worker_adapter.is_healthy):
            d.step()
            d.idle()
    store_prefix(d, "A2")
    forget_locally(d)
    b = d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
    step_until_computed(d, b, len(PREFIX))
    assert kv_is_exact(d, "B", PREFIX)
    run(d)
    assert d.finished["B"]["num_extra_cached_tokens"] == 48
    assert_nothing_left(d)


# ------------------------------------------------------------------ stats


def test_lmcache_stats_and_kvmux_counters_reach_vllms_stats_path(lmcache_server, make_sim):
    """What vLLM's stat loggers receive, rebuilt and summed over the run:
    LMCache's own stats under its child name beside kvmux's counters."""
    from kvmux.mux.stats import KvmuxStats

    d = make_sim([lmcache_server.child(), host_child()])
    store_prefix(d)
    forget_locally(d)
    d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
    run(d)
    total = KvmuxStats()
    for entry in d.kv_stats:
        total.aggregate(KvmuxStats.rebuild(entry))
    seen = total.reduce()
    assert seen["LMCacheMPConnector.LMCache MP lookup count"] == 2
    assert seen["kvmux.children.LMCacheMPConnector.loads"] == 1
    assert seen["kvmux.children.LMCacheMPConnector.load_tokens"] == 48
    assert seen["kvmux.extra_cached_tokens"] == 48
    assert seen["kvmux.finished"] == 2


# ----------------------------------------------------------------- README


def readme_lmcache_section() -> str:
    return (Path(__file__).resolve().parents[2] / "docs" / "lmcache.md").read_text()


def test_the_readme_server_command_is_the_one_the_tests_run(lmcache_server):
    section = readme_lmcache_section()
    cmd = re.search(r"LMCACHE_TRACK_USAGE=false python (-m .*?)\n\s*```", section, re.S)
    assert cmd is not None
    words = cmd.group(1).replace("\\\n", " ").split()
    ours = lmcache_server.command()[1:]
    ours[ours.index("--port") + 1] = "5555"
    assert words == ours


# ----------------------------------------------------------------- aborts


def abort(d: SchedulerSim, req_id: str) -> None:
    d.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)


def test_aborting_a_request_lmcache_never_saw_leaves_the_engine_serving(lmcache_server, make_sim):
    """A client disconnects while its request, which asked for
    ``cached_token_stats``, still waits before any lookup. LMCache's
    ``request_finished`` fails on it (no tracker); kvmux contains that (under
    ``python -O`` too, where the failure is a different one): no exception
    leaves the scheduler, and the next request loads from LMCache as usual."""
    if os.environ.get("KVMUX_EXPECT_OPTIMIZE"):
        assert sys.flags.optimize  # run under python -O by the test below
    d = make_sim([lmcache_server.child(), host_child()])
    store_prefix(d)
    forget_locally(d)
    d.add("C", PREFIX + [5], kv_transfer_params=ASK)
    abort(d, "C")
    assert d.connector.mux_stats()["children"][LM]["contained_errors"] == 1
    b = d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
    step_until_computed(d, b, len(PREFIX))
    assert kv_is_exact(d, "B", PREFIX)
    run(d)
    assert d.finished["B"]["num_extra_cached_tokens"] == 48
    assert "C" not in d.finished_sending
    assert d.connector.num_live_requests() == 0
    assert d.worker.num_pending_async_saves() == 0
    assert lm_trackers(d) == {}


def test_the_same_abort_is_contained_under_python_O():
    """The test above, in a fresh ``python -O`` (asserts compiled out, so
    LMCache fails with another error; kvmux guards nothing with assert)."""
    name = "test_aborting_a_request_lmcache_never_saw_leaves_the_engine_serving"
    test = f"tests/mux/{Path(__file__).name}::{name}"
    proc = subprocess.run(
        [sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=Path(__file__).resolve().parents[2],  # the repository root
        env=dict(os.environ, KVMUX_EXPECT_OPTIMIZE="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout


def test_vllms_multiconnector_lets_the_same_abort_crash_the_scheduler(
    lmcache_server, model_dir, tmp_path
):
    """The rival, for the record: vLLM's in-tree MultiConnector over
    [LMCacheMPConnector, ExampleConnector] lets LMCache's failure out of the
    scheduler, which in a serving engine kills the engine core."""
    children = [
        lmcache_server.child(),
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")},
        },
    ]
    d = SchedulerSim(upstream_config(children), model_dir=model_dir, idle_wait_s=0.02)
    try:
        d.add("C", PREFIX + [5], kv_transfer_params=ASK)
        with pytest.raises((AssertionError, KeyError)):
            abort(d, "C")
    finally:
        d.close()


def test_lmcache_beside_a_child_failing_on_a_request_it_took_part_in(lmcache_server, make_sim):
    """Contained is only what a child never saw: a child that looked the
    request up and then fails still reaches vLLM named, and LMCache was told
    the request finished all the same (it keeps no tracker for it)."""
    failing = {
        "kv_connector": "ScriptedConnector",
        "kv_connector_module_path": "tests.support.scripted",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"fail": "request_finished"},
    }
    d = make_sim([lmcache_server.child(), failing])
    d.add("R", PREFIX + [5], kv_transfer_params=ASK)
    d.step()  # looked up by both (LMCache is not ready yet)
    assert "R" in lm_trackers(d)
    with pytest.raises(KvmuxChildError) as err:
        abort(d, "R")
    assert err.value.child == "ScriptedConnector" and err.value.hook == "request_finished"
    assert lm_trackers(d) == {}
    assert d.connector.num_live_requests() == 0
    assert d.connector.mux_stats()["children"][LM]["contained_errors"] == 0
