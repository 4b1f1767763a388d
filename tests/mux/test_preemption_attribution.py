"""Attribution after a preemption (issue 23, item 3): each token of a
request is credited once, to the first source that supplied it.

Through vLLM 0.33's real v1 ``Scheduler`` with kvmux over the real
``KvmuxHostCache`` (``tests/support/harness.py``); preemptions are forced by a small
device KV cache. A preempted request is looked up again from scratch; vLLM's
prefix cache may then hold what the host tier loaded before. The rule under
test (``rust/mux/scheduler/admission.rs``, ``Credits``): the tokens an earlier admission credited
(to vLLM's local prefix cache or a child) stay credited, and a later
admission credits only the tokens after them, so ``cached_tokens_by_child``
sums to ``num_extra_cached_tokens`` and no token is counted by two sources
(on 787259b the request below reported 48 extra tokens, 0 by the host tier
and the same 48 again as ``local_prefix_cache``).
"""

from __future__ import annotations

from typing import Any

from tests.host_tier.test_host_cache import PREFIX, host_child
from tests.support import harness
from tests.support.harness import mux_config

WANT = {"cached_tokens_by_child": True, "num_extra_cached_tokens": True}
HOST = "KvmuxHostCache"
HOST_STATS = {"host_cache_stats": True}


def warm(d: Any) -> None:
    """The host tier holds PREFIX (3 blocks); vLLM's prefix cache does not."""
    d.add("A", PREFIX + [1])
    d.run()
    d.scheduler.reset_prefix_cache()


def run(d: Any) -> list[str]:
    preempted: list[str] = []
    for _ in range(400):
        if not d.scheduler.requests:
            return preempted
        so = d.step()
        preempted += list(so.preempted_req_ids or ())
    raise AssertionError("the scheduler did not drain")


def assert_counted_once(params: dict[str, Any], num_tokens: int) -> None:
    """The split adds up, and covers at most the request's tokens (a resumed
    request's prompt and the outputs it had before its preemption)."""
    split = dict(params["cached_tokens_by_child"])
    local = split.pop("local_prefix_cache")
    assert sum(split.values()) == params["num_extra_cached_tokens"], params
    assert sum(split.values()) + local <= num_tokens, f"a token counted twice: {params}"


def test_a_request_resumed_from_vllms_cache_keeps_the_host_tiers_credit():
    """B loads 48 tokens from the host tier, is preempted (C needs its
    blocks) and resumes from vLLM's prefix cache, which still holds them:
    the host tier supplied those 48 tokens, vLLM's cache none of them, and
    the counters say the same."""
    d = harness.SchedulerSim(mux_config([host_child()]), num_blocks=8)
    warm(d)
    d.add("C", list(range(1000, 1043)), max_tokens=15)
    d.step()
    d.add("B", PREFIX + [2], max_tokens=14, kv_transfer_params=WANT)
    assert "B" in run(d), "B was not preempted; resize the cache"
    stats = d.connector.mux_stats()
    assert stats["children"][HOST]["loads"] == 1, "B resumed from vLLM's cache, not reloaded"
    assert d.finished["B"] == {
        "num_extra_cached_tokens": 48,
        "cached_tokens_by_child": {HOST: 48, "local_prefix_cache": 0},
    }
    assert stats["children"][HOST]["served_tokens"] == 48
    assert stats["local_cached_tokens"] == 0


def test_after_any_preemption_the_split_adds_up_and_counts_each_token_once():
    """Requests sharing prefixes of 1 to 3 host-tier blocks, preempted under
    several cache sizes (resumed from vLLM's cache, from the host tier, or
    from both): every request's split adds up, no token is counted twice,
    and the counters are the sum of the requests' splits. The host tier's
    own ``host_cache_stats.loaded_tokens`` counts a span it reloads for a
    resumed request once too (it added each reload before: 288 loaded
    tokens for a 164-token request, found by the soak)."""
    for num_blocks in (8, 9, 10, 14):
        d = harness.SchedulerSim(mux_config([host_child()]), num_blocks=num_blocks, max_num_seqs=4)
        warm(d)
        prompts = {f"p{i}": PREFIX[: 16 * (1 + i % 3)] + [i] * 20 for i in range(6)}
        for req_id, prompt in prompts.items():
            d.add(req_id, prompt, max_tokens=30, kv_transfer_params=WANT | HOST_STATS)
        assert run(d), f"num_blocks={num_blocks} did not preempt"
        served = local = 0
        for req_id, prompt in prompts.items():
            params = d.finished[req_id]
            num_tokens = len(prompt) + len(d.outputs[req_id])
            assert_counted_once(params, num_tokens)
            own = params["host_cache_stats"]["loaded_tokens"]
            assert params["cached_tokens_by_child"][HOST] <= own <= len(prompt), params
            served += params["cached_tokens_by_child"][HOST]
            local += params["cached_tokens_by_child"]["local_prefix_cache"]
        stats = d.connector.mux_stats()
        assert stats["children"][HOST]["served_tokens"] == served
        assert stats["local_cached_tokens"] == local


def test_a_span_the_host_tier_reloads_after_a_preemption_is_counted_once():
    """B loads 48 tokens from the host tier; a reset that preempts running
    requests (``/reset_prefix_cache?reset_running_requests=true``) empties
    vLLM's cache, so B loads the same 48 again on resume: the tier did work
    twice (its ``loaded_tokens`` stat says 96), but it supplied B 48 tokens,
    which is what B's ``host_cache_stats`` and kvmux's split say (787259b's
    tier said 96: the soak's finding)."""
    d = harness.SchedulerSim(mux_config([host_child()]))
    warm(d)
    d.add("B", PREFIX + [2], max_tokens=8, kv_transfer_params=WANT | HOST_STATS)
    d.step()
    assert d.scheduler.reset_prefix_cache(reset_running_requests=True)
    run(d)
    stats = d.connector.mux_stats()
    assert stats["children"][HOST]["loads"] == 2, "B was not reloaded from the host tier"
    assert d.finished["B"]["host_cache_stats"]["loaded_tokens"] == 48
    assert d.finished["B"]["cached_tokens_by_child"] == {HOST: 48, "local_prefix_cache": 0}
    assert d.finished["B"]["num_extra_cached_tokens"] == 48
