"""Save admission with the real LMCache behind kvmux's host tier: vLLM's
real v1 ``Scheduler`` and worker side drive ``KvmuxConnector`` over
``[KvmuxHostCache, LMCacheMPConnector]`` against a real LMCache MP server
(``tests/support/lmcache_server.py``). LMCache's ``request_finished``
always answers "saving asynchronously": a declined save must leave nothing
pending, nothing in LMCache, and the outputs unchanged.
"""

from __future__ import annotations

import pytest

from tests.mux.test_lmcache import HOST, LM, forget_locally, host_child, run
from tests.support.harness import SchedulerSim, mux_config

pytestmark = pytest.mark.usefixtures("lmcache_runs")

PREFIX = list(range(700, 748))  # 48 tokens: 3 vLLM blocks = 3 LMCache chunks
ASK = {"cached_token_stats": True, "num_extra_cached_tokens": True}


@pytest.fixture
def make(lmcache_server, model_dir):
    built: list[SchedulerSim] = []

    def build(save_policy: str) -> SchedulerSim:
        children = [host_child(), {**lmcache_server.child(), "save_policy": save_policy}]
        # The simulator computes a token for next to nothing: vLLM's load
        # rule, so that LMCache's hits are loaded.
        ktc = mux_config(children, load_decision="always")
        d = SchedulerSim(ktc, model_dir=model_dir, idle_wait_s=0.02)
        built.append(d)
        return d

    yield build
    for d in built:
        d.close()


def lm_stats(d: SchedulerSim) -> dict:
    return d.connector.mux_stats()["children"][LM]


def served_from_lmcache(d: SchedulerSim, req_id: str) -> int:
    """Forget every copy but LMCache's, then run ``req_id`` over the prefix;
    the tokens LMCache loaded for it."""
    forget_locally(d)
    before = lm_stats(d)["load_tokens"]
    tokens = PREFIX + [9] * 5
    d.add(req_id, tokens, kv_transfer_params=ASK, max_tokens=2)
    run(d)
    assert d.outputs[req_id]
    return lm_stats(d)["load_tokens"] - before


def test_a_prefix_seen_once_never_reaches_lmcache_and_leaves_nothing_pending(make):
    d = make("auto")
    d.add("A", PREFIX + [1, 2, 3], max_tokens=2)
    run(d)
    assert lm_stats(d)["declined_saves"] == 1
    assert lm_stats(d)["async_saves"] == 0, "LMCache's async answer was not counted"
    assert d.connector.num_pending_async_saves() == 0
    assert d.connector.num_live_requests() == 0
    assert "A" in d.finished
    assert d.connector.mux_stats()["children"][HOST]["declined_saves"] == 0
    # Nothing half-written: with vLLM's cache and the host tier wiped,
    # LMCache has none of it (B is seen a second time: it is admitted).
    assert served_from_lmcache(d, "B") == 0


def test_a_prefix_seen_twice_is_written_to_lmcache(make):
    d = make("auto")
    d.add("A", PREFIX + [1, 2, 3], max_tokens=2)
    run(d)
    # The second sighting (vLLM's prefix cache holds the prefix): admitted.
    d.add("A2", PREFIX + [4, 5, 6], max_tokens=2)
    run(d)
    assert lm_stats(d)["declined_saves"] == 1
    got = served_from_lmcache(d, "B")
    assert got >= len(PREFIX), got
    # Outputs do not change: the same tokens as with every save taken.
    ref = make("always")
    for r, toks in (("A", PREFIX + [1, 2, 3]), ("A2", PREFIX + [4, 5, 6])):
        ref.add(r, toks, max_tokens=2)
        run(ref)
    served_from_lmcache(ref, "B")
    assert {r: d.outputs[r] for r in ("A", "A2", "B")} == {
        r: ref.outputs[r] for r in ("A", "A2", "B")
    }


def test_save_policy_always_writes_a_prefix_seen_once(make):
    d = make("always")
    d.add("A", PREFIX + [1, 2, 3], max_tokens=2)
    run(d)
    assert lm_stats(d)["declined_saves"] == 0
    assert served_from_lmcache(d, "B") >= len(PREFIX)
