"""What a client sends, and the edge between Python and Rust, never take the
engine down (issue 23, items 1, 4, 5 and 6). ``kv_transfer_params`` come
from any HTTP client verbatim, and an exception out of a scheduler hook
kills vLLM's engine core for every user; so do a panic, an abort or a
deadlock in the Rust core. Through vLLM 0.33's real ``Scheduler``
(``tests.support.harness``) and kvmux's real children."""

from __future__ import annotations

import threading

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvmux import KvmuxConfigError, KvmuxConnector, KvmuxHostCache
from kvmux._core import BY_CHILD_KEY, LOCAL_KEY, HostIndex
from kvmux.mux.config import parse_mux_config
from tests.host_tier.test_host_cache import PREFIX, host_cache, host_child
from tests.support.harness import mux_config, scripted
from tests.support.scripted import ScriptedConnector
from tests.support.sim import make_request

STATS = {"host_cache_stats": True, "num_extra_cached_tokens": True}


def named(name: str, **extra):
    return {**host_child(**extra), "name": name}


def two_tiers(**extra):
    return mux_config([named("hot", num_blocks=64), named("warm", num_blocks=64)], **extra)


def serve_twice(d, params, prompt=PREFIX):
    """Compute ``prompt`` once (both tiers save it), forget it in vLLM's
    own prefix cache, then serve it again from a tier with ``params``."""
    d.add("first", prompt + [1], kv_transfer_params=params)
    d.run()
    d.scheduler.reset_prefix_cache()
    d.add("again", prompt + [2], kv_transfer_params=params)
    d.run()
    return d.finished["first"], d.finished["again"]


# ------------------------------------------- item 1: clashes a client chose


@pytest.mark.parametrize("clash_policy", ["error", "strict", "first", "last"])
def test_two_host_tiers_asked_for_their_stats_answer_each_by_name(driver_factory, clash_policy):
    """A hot and a warm tier both answer ``host_cache_stats``: the request
    asked for it, so it gets each tier's, keyed by tier name, under every
    clash policy (787259b raised KvmuxParamClash in update_from_output,
    killing the engine); counted once per request, warned once per key."""
    d = driver_factory(two_tiers(clash_policy=clash_policy))
    first, again = serve_twice(d, STATS)
    assert set(again["host_cache_stats"]) == {"hot", "warm"}
    assert again["host_cache_stats"]["hot"]["loaded_tokens"] == 48
    assert again["host_cache_stats"]["warm"]["loaded_tokens"] == 0
    assert again["num_extra_cached_tokens"] == 48
    assert first["host_cache_stats"]["hot"]["saved_blocks"] == 3
    stats = d.connector.mux_stats()
    assert stats["clashes_resolved"] == 2 and stats["clashes_raised"] == 0
    assert stats["live_requests"] == 0


def test_a_key_nobody_asked_for_still_follows_the_clash_policy(driver_factory):
    """The exemption is for keys the request named: two children that
    always answer one key with different values are still refused under
    ``error`` (the contract in design.md), and counted."""
    from kvmux import KvmuxParamClash

    d = driver_factory(
        mux_config([scripted(params={"k": 1}), {**scripted(params={"k": 2}), "name": "other"}])
    )
    d.add("r", PREFIX + [1])
    with pytest.raises(KvmuxParamClash, match="'k'"):
        d.run()


def test_nested_kvmux_asked_for_its_split_answers_with_the_outer_one(driver_factory):
    """kvmux as a child of kvmux: both answer ``cached_tokens_by_child`` and
    ``num_extra_cached_tokens``; the outer multiplexer's own keys win (its
    split names the inner kvmux as one child), never a clash error."""
    inner = {
        "kv_connector": "KvmuxConnector",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [host_child()]},
        "name": "inner",
    }
    want = {BY_CHILD_KEY: True, "num_extra_cached_tokens": True}
    for policy in ("error", "strict"):
        d = driver_factory(mux_config([inner, scripted()], clash_policy=policy))
        _, again = serve_twice(d, want)
        assert again[BY_CHILD_KEY] == {"inner": 48, "ScriptedConnector": 0, LOCAL_KEY: 0}
        assert again["num_extra_cached_tokens"] == 48
        assert d.connector.mux_stats()["clashes_raised"] == 0


# ------------------------------------------ item 4: ids and salts are opaque


def test_lone_surrogate_request_ids_and_cache_salts_are_served(driver_factory):
    """A client-chosen request id or ``cache_salt`` holding a lone surrogate
    (not UTF-8) is an opaque key like any other: looked up, loaded, saved
    and finished, two such ids kept apart (787259b raised
    UnicodeEncodeError in the Rust conversion and in the tier's salt)."""
    d = driver_factory(mux_config([host_child(), scripted()]))

    def add(req_id, tokens, salt):
        req = make_request(req_id, tokens, hashed=False, kv_transfer_params=STATS)
        req.cache_salt = salt
        d.scheduler.add_request(req)
        d.requests[req_id] = req
        return req

    add("a\ud800", PREFIX + [1], "s\udfff")
    add("a\ud801", PREFIX + [1], "s\udffe")
    d.run()
    d.scheduler.reset_prefix_cache()
    add("b\ud800", PREFIX + [2], "s\udfff")  # the first salt: served from the tier
    add("c", PREFIX + [2], "s\udffd")  # a salt never seen: nothing to serve
    d.run()
    assert d.finished["b\ud800"]["num_extra_cached_tokens"] == 48
    assert d.finished["c"]["num_extra_cached_tokens"] == 0
    assert d.connector.num_live_requests() == 0
    assert d.connector.mux_stats()["finished"] == 4


# ------------------------------------------------------ item 5: the FFI edge


class InterruptingConnector(ScriptedConnector):
    """A child whose lookup is interrupted (Ctrl-C reaching the engine while
    a child runs, or a SystemExit out of it)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        raise KeyboardInterrupt


def test_a_keyboard_interrupt_in_a_child_is_not_swallowed_as_a_miss(driver_factory):
    """With the default breaker a child's exception is a contained miss; a
    ``BaseException`` that is not an ``Exception`` passes through as it is
    (787259b counted it as a lookup error and went on)."""
    child = {**scripted(), "kv_connector": "InterruptingConnector"}
    child["kv_connector_module_path"] = __name__
    d = driver_factory(mux_config([host_child(), child]))
    d.add("r", PREFIX + [1])
    with pytest.raises(KeyboardInterrupt):
        d.step()
    assert d.connector.num_live_requests() == 0
    assert d.connector.mux_stats()["children"]["InterruptingConnector"]["lookup_errors"] == 0


class Grows:
    """An int-like value whose conversion adds keys to the dict holding it."""

    def __init__(self, into: dict, n: int) -> None:
        self.into, self.n = into, n

    def __index__(self) -> int:
        for i in range(64):
            self.into[f"added-{self.n}-{i}"] = (1, 1)
        return 1


def test_a_dict_that_changes_while_kvmux_reads_it_is_no_panic(h):
    """The worker's ``expect`` reads the metadata's dicts; a value whose
    conversion runs Python code that grows the dict made PyO3 panic
    (787259b); now the items are read from a copy."""
    cfg = h.vllm_config(mux_config([host_child(), scripted(load_async=True)]))
    conn = KvmuxConnector(cfg, KVConnectorRole.WORKER, h.kv_cache_config())
    saves: dict = {}
    saves["r"] = (Grows(saves, 0), 1)
    conn._worker.mux.expect(saves=saves, loads=None)
    assert conn._worker.mux.pending_sends() == 1


def test_a_key_whose_repr_uses_the_index_does_not_deadlock():
    """A bad key's error message calls its ``repr``; a ``repr`` that asks the
    same host index used to run under the index's lock (a deadlock); now the
    keys are checked before the lock is taken."""
    ix = HostIndex(8)

    class Evil:
        def __repr__(self) -> str:
            return f"Evil(prefix={ix.longest_prefix([b'x'])})"

    result: list = []

    def call():
        try:
            ix.longest_prefix([Evil()])
        except ValueError as e:
            result.append(str(e))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "deadlocked under the index's lock"
    assert result and "Evil(prefix=0)" in result[0]


def test_an_index_beyond_memory_raises_instead_of_aborting():
    """Allocating the host index is fallible and sized against the machine
    (787259b aborted the process: ``memory allocation ... failed``)."""
    with pytest.raises(MemoryError, match="more than this machine"):
        HostIndex((1 << 32) - 2, 1024)


def test_a_cooldown_past_the_clocks_range_is_refused_by_the_core_not_a_panic():
    """``kvmux._core`` is public, so its constructor applies the same bounds
    as the config (``rust/mux/settings.rs``): a cooldown past what the clock
    holds (opening a breaker added it to the clock, a Rust panic in 787259b:
    ``overflow when adding duration to instant``) is a ValueError naming the
    setting; the longest one allowed opens the breaker for the far future."""
    import logging
    from types import SimpleNamespace

    from kvmux._core import SchedulerMux

    def lookup(request, num_computed_tokens):
        raise RuntimeError("cache server gone")

    def build(cooldown_ms):
        return SchedulerMux(
            [("flaky", False, None, None, (1, cooldown_ms, cooldown_ms))],
            "error",
            "first",
            16,
            {"get_num_new_matched_tokens": [("works", lookup)]},
            logging.getLogger("kvmux.test"),
        )

    with pytest.raises(ValueError, match="breaker_cooldown_ms=[0-9]+ is out of bounds"):
        build(1e22)  # ms: 3e11 years, past what an Instant holds
    mux = build(999_999_999.0)
    assert mux.get_num_new_matched_tokens(SimpleNamespace(request_id="r"), 0) == (0, False)
    assert mux.stats()["breakers"] == {"flaky": "open"}
    # Open: skipped (a miss), not asked, not a panic.
    assert mux.get_num_new_matched_tokens(SimpleNamespace(request_id="s"), 0) == (0, False)


# ------------------------------------------------------ item 6: bad configs


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"breaker_failures": 2**32}, ["breaker_failures", "4294967295"]),
        ({"breaker_failures": 2**40}, ["breaker_failures"]),
        ({"breaker_cooldown_ms": 1e-7}, ["breaker_cooldown_ms", "at least 1"]),
        ({"name": "local_prefix_cache"}, ["'local_prefix_cache'", "another name"]),
        ({"name": "kvmux"}, ["'kvmux'", "another name"]),
    ],
)
def test_bad_child_entries_are_config_errors_naming_the_key(h, entry, words):
    cfg = mux_config([{**scripted(), **entry}, host_child()])
    with pytest.raises(KvmuxConfigError) as err:
        parse_mux_config(cfg)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_a_given_name_equal_to_a_generated_one_is_refused(h):
    """``AdvConnector#1`` given to one child while kvmux names a repeated
    class's child that way would merge two children's stats."""
    cfg = mux_config([{**scripted(), "name": "ScriptedConnector#1"}, scripted(), scripted()])
    with pytest.raises(KvmuxConfigError, match="'ScriptedConnector#1'"):
        parse_mux_config(cfg)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"capacity_gib": float("inf")}, ["capacity_gib", "finite"]),
        ({"capacity_gib": 1e300}, ["capacity_gib", "machine's memory"]),
        ({"capacity_gib": 1e-12}, ["capacity_gib", "holds no KV block"]),
        ({"num_blocks": 2**32}, ["num_blocks"]),
        ({"num_blocks": 2**64}, ["num_blocks"]),
        ({"num_blocks": 2**31}, ["num_blocks", "machine's"]),
    ],
)
def test_bad_host_capacity_is_a_config_error_on_either_role(h, role, extra, words):
    """Alone and under kvmux, scheduler and worker alike: a capacity that
    is not a number of GiB this machine holds is a KvmuxConfigError naming
    the key (787259b: OverflowError, ValueError or KvmuxChildError, and the
    worker role accepted num_blocks 2**32)."""
    alone = h.vllm_config(host_cache(**extra))
    with pytest.raises(KvmuxConfigError) as err:
        KvmuxHostCache(alone, role, h.kv_cache_config())
    for w in words:
        assert w in str(err.value), str(err.value)
    under = h.vllm_config(mux_config([host_child(**extra)]))
    with pytest.raises(KvmuxConfigError) as err:
        KvmuxConnector(under, role, h.kv_cache_config())
    for w in words:
        assert w in str(err.value), str(err.value)
