"""The behaviour contract of ``KvmuxConnector`` (docs: design.md), driven
through vLLM's real classes: ``KVTransferConfig``, ``VllmConfig``, the
connector factory, ``Request`` and the v1 ``Scheduler``."""

from __future__ import annotations

import logging

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import kvmux
from kvmux import KvmuxChildError, KvmuxConfigError, KvmuxConnector, KvmuxParamClash
from tests.support.harness import (
    NOOP,
    SCRIPTED,
    child,
    mux_config,
    scripted,
    upstream_config,
    vllm_config,
)

SCHED = KVConnectorRole.SCHEDULER


def build(children, role=SCHED, **extra):
    cfg = vllm_config(mux_config(children, **extra))
    return KVConnectorFactory.create_connector(cfg, role, _kvc())


def _kvc():
    from tests.support.harness import kv_cache_config

    return kv_cache_config()


def req(h, rid="r", n=64, **kw):
    return h.make_request(rid, range(n), **kw)


# ---------------------------------------------------------------- loading


def test_vllm_loads_kvmux_by_module_path_for_both_roles():
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = build(
            [scripted(), child("ExampleConnector", shared_storage_path="/tmp/kvmux-ex")], role=role
        )
        assert type(conn) is KvmuxConnector
        assert conn.child_names == ["ScriptedConnector", "ExampleConnector"]
        assert conn.role is role


def test_children_of_one_class_get_distinct_names():
    conn = build([scripted(), scripted(matched=16)])
    assert conn.child_names == ["ScriptedConnector#0", "ScriptedConnector#1"]


# ------------------------------------------------------------ config errors


@pytest.mark.parametrize(
    ("extra", "must_mention"),
    [
        ({"connectors": [scripted()], "clash_polcy": "first"}, ["clash_polcy", "clash_policy"]),
        ({}, ["connectors"]),
        ({"connectors": []}, ["empty"]),
        ({"connectors": scripted()}, ["connectors", "list"]),
        (
            {"connectors": [scripted()], "clash_policy": "loud"},
            ["clash_policy", "'loud'", "strict"],
        ),
        ({"connectors": [scripted()], "load_policy": "biggest"}, ["load_policy", "longest"]),
        ({"connectors": ["ExampleConnector"]}, ["connectors[0]", "dict"]),
        ({"connectors": [{"kv_role": "kv_both"}]}, ["connectors[0]", "kv_connector"]),
        (
            {"connectors": [{"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}]},
            ["NoSuchConnector", "kv_connector_module_path"],
        ),
        (
            {
                "connectors": [
                    {
                        "kv_connector": "X",
                        "kv_role": "kv_both",
                        "kv_connector_module_path": "no_such_module_kvmux",
                    }
                ]
            },
            ["no_such_module_kvmux", "installed"],
        ),
        (
            {
                "connectors": [
                    {
                        "kv_connector": "ScriptedConnector",
                        "kv_role": "boss",
                        "kv_connector_module_path": SCRIPTED,
                    }
                ]
            },
            ["connectors[0]", "boss"],
        ),
    ],
)
def test_bad_config_is_refused_at_construction_naming_the_problem(extra, must_mention):
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KvmuxConnector",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    with pytest.raises(KvmuxConfigError) as err:
        KvmuxConnector(vllm_config(ktc), SCHED, _kvc())
    assert isinstance(err.value, ValueError)
    for word in must_mention:
        assert word in str(err.value)


def test_every_config_problem_is_reported_at_once():
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KvmuxConnector",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [scripted()], "oops": 1, "load_policy": "x"},
    )
    with pytest.raises(KvmuxConfigError) as err:
        KvmuxConnector(vllm_config(ktc), SCHED, _kvc())
    assert len(err.value.problems) == 2
    assert "oops" in str(err.value) and "load_policy" in str(err.value)


def test_children_inherit_the_parent_role_when_they_name_none():
    conn = build([{"kv_connector": "ScriptedConnector", "kv_connector_module_path": SCRIPTED}])
    assert conn.children[0]._kv_transfer_config.kv_role == "kv_both"


def test_a_child_that_fails_to_start_is_named_and_the_others_are_shut_down(monkeypatch):
    from tests.support import scripted as sc

    shut = []
    monkeypatch.setattr(sc.ScriptedConnector, "shutdown", lambda self: shut.append(self))
    with pytest.raises(kvmux.KvmuxChildError) as err:
        build([scripted(), scripted(fail="__init__")])
    assert "ScriptedConnector#1" in str(err.value) and "__init__" in str(err.value)
    assert len(shut) == 1


# ------------------------------------------------------------- load policy


def _lookup(conn, h, rid="r", computed=0):
    return conn.get_num_new_matched_tokens(req(h, rid), computed)


def test_first_load_policy_picks_the_first_child_with_hits(h):
    conn = build([scripted(matched=0), scripted(matched=16), scripted(matched=48)])
    assert _lookup(conn, h) == (16, False)
    r = req(h)
    conn.update_state_after_alloc(r, None, 16)
    got = [c.calls[-1] for c in conn.children]
    assert got == [("alloc", ("r", 0)), ("alloc", ("r", 16)), ("alloc", ("r", 0))]


def test_longest_load_policy_picks_most_tokens_ties_to_earlier(h):
    conn = build(
        [scripted(matched=16), scripted(matched=48, load_async=True), scripted(matched=48)],
        load_policy="longest",
    )
    assert _lookup(conn, h) == (48, True)
    conn.update_state_after_alloc(req(h), None, 48)
    assert [c.calls[-1][1][1] for c in conn.children] == [0, 48, 0]


def test_any_child_not_ready_means_not_ready_then_the_count(h):
    conn = build([scripted(matched=32, not_ready=2), scripted(matched=16)])
    assert _lookup(conn, h) == (None, False)
    assert _lookup(conn, h) == (None, False)
    assert _lookup(conn, h) == (32, False)


def test_nothing_matched_means_zero_and_nobody_loads(h):
    conn = build([scripted(), scripted()])
    assert _lookup(conn, h) == (0, False)
    conn.update_state_after_alloc(req(h), None, 0)
    assert all(c.calls[-1] == ("alloc", ("r", 0)) for c in conn.children)


# ------------------------------------------------------------ clash policy


def _finish(conn, h, rid="r", **kw):
    return conn.request_finished(req(h, rid, **kw), [0, 1])


def test_error_policy_merges_equal_values(h):
    conn = build(
        [scripted(params={"a": 1, "same": [1, 2]}), scripted(params={"b": 2, "same": [1, 2]})]
    )
    assert _finish(conn, h) == (False, {"a": 1, "same": [1, 2], "b": 2})


def test_error_policy_raises_naming_the_key_and_both_children(h):
    conn = build(
        [
            scripted(params={"k": 1}),
            child("NoopConnector", module=NOOP),
            scripted(params={"k": 2}),
        ]
    )
    with pytest.raises(KvmuxParamClash) as err:
        _finish(conn, h)
    e = err.value
    assert isinstance(e, RuntimeError)
    assert (e.key, e.first, e.second) == ("k", "ScriptedConnector#0", "ScriptedConnector#2")
    assert "'k'" in str(e) and "ScriptedConnector#0" in str(e) and "ScriptedConnector#2" in str(e)
    assert conn.num_live_requests() == 0


def test_strict_policy_refuses_even_equal_values(h):
    conn = build([scripted(params={"k": 1}), scripted(params={"k": 1})], clash_policy="strict")
    with pytest.raises(KvmuxParamClash, match="strict"):
        _finish(conn, h)


@pytest.mark.parametrize(("policy", "kept"), [("first", 1), ("last", 2)])
def test_first_and_last_keep_one_count_and_warn_once_per_key(h, policy, kept, caplog):
    conn = build(
        [scripted(params={"k": 1, "x": 0}), scripted(params={"k": 2})], clash_policy=policy
    )
    with caplog.at_level(logging.WARNING, logger="kvmux"):
        for i in range(3):
            assert _finish(conn, h, f"r{i}") == (False, {"k": kept, "x": 0})
    assert conn.mux_stats()["clashes_resolved"] == 3
    warnings = [r for r in caplog.records if "'k'" in r.getMessage()]
    assert len(warnings) == 1


# ------------------------------------------------------ extra cached tokens


def test_extra_cached_tokens_are_the_tokens_the_loading_child_supplied(h):
    conn = build([scripted(matched=0, params={"p": 1}), scripted(matched=48)])
    r = req(h, n=80, kv_transfer_params={"num_extra_cached_tokens": None})
    assert conn.get_num_new_matched_tokens(r, 16) == (32, False)  # 48 - 16 local
    conn.update_state_after_alloc(r, None, 32)
    conn.update_state_after_alloc(r, None, 0)  # vLLM's second call after a load
    assert conn.request_finished(r, [0]) == (False, {"p": 1, "num_extra_cached_tokens": 32})


def test_extra_cached_tokens_is_zero_when_nothing_loaded_and_absent_unless_asked(h):
    conn = build([scripted(matched=0)])
    r = req(h, kv_transfer_params={"num_extra_cached_tokens": True})
    conn.get_num_new_matched_tokens(r, 0)
    conn.update_state_after_alloc(r, None, 0)
    assert conn.request_finished(r, []) == (False, {"num_extra_cached_tokens": 0})
    r2 = req(h, "plain")
    conn.get_num_new_matched_tokens(r2, 0)
    assert conn.request_finished(r2, []) == (False, None)


def test_childrens_own_keys_pass_through_beside_kvmuxs(h):
    stats = {"cached_token_stats": {"num_lmcache_extra_cached_tokens": 16}}
    conn = build([scripted(params=stats), scripted(params={"remote_host": "p0"})])
    r = req(h, kv_transfer_params={"num_extra_cached_tokens": 1})
    _, params = conn.request_finished(r, [])
    assert params == {**stats, "remote_host": "p0", "num_extra_cached_tokens": 0}


# ----------------------------------------------------- unknown / repeated


def test_finishing_a_request_never_seen_or_twice_is_safe(h):
    conn = build([scripted(params={"a": 1}), scripted()])
    r = req(h, kv_transfer_params={"num_extra_cached_tokens": 1})
    assert conn.request_finished(r, []) == (False, {"a": 1, "num_extra_cached_tokens": 0})
    assert conn.request_finished(r, []) == (False, {"a": 1, "num_extra_cached_tokens": 0})
    assert conn.num_live_requests() == 0


# ------------------------------------------------------------- worker side


def test_per_layer_hooks_call_only_children_that_do_something():
    noop = child("NoopConnector", module=NOOP)
    worker = build([noop, scripted(layer_work=True), noop], role=KVConnectorRole.WORKER)
    working = worker.children[1]
    # The single working child's hook is called directly, no wrapper.
    assert worker.wait_for_layer_load == working.wait_for_layer_load
    assert worker.save_kv_layer == working.save_kv_layer
    worker.wait_for_layer_load("L0")
    worker.save_kv_layer("L0", None, None)
    assert working.layers_seen == ["L0", "L0"]
    idle = build([noop, noop], role=KVConnectorRole.WORKER)
    assert idle.wait_for_layer_load("L0") is None
    both = build(
        [scripted(layer_work=True), scripted(layer_work=True)], role=KVConnectorRole.WORKER
    )
    both.wait_for_layer_load("L1")
    assert [c.layers_seen for c in both.children] == [["L1"], ["L1"]]


def test_a_per_layer_failure_reaches_vllm_as_the_child_raised_it():
    """The README's one exception to "a failing child is named": on the
    per-layer path the instance's hook is the working child's own, so its
    exception reaches vLLM unchanged; the step's other hooks name the child."""
    noop = child("NoopConnector", module=NOOP)
    for hook in ("save_kv_layer", "wait_for_layer_load"):
        worker = build([noop, scripted(fail=hook)], role=KVConnectorRole.WORKER)
        args = ("L0", None, None) if hook == "save_kv_layer" else ("L0",)
        with pytest.raises(RuntimeError, match=f"scripted failure in {hook}") as got:
            getattr(worker, hook)(*args)
        assert not isinstance(got.value, KvmuxChildError)
    worker = build([noop, scripted(fail="wait_for_save")], role=KVConnectorRole.WORKER)
    with pytest.raises(KvmuxChildError, match="'ScriptedConnector' failed in wait_for_save"):
        worker.wait_for_save()


def test_every_hook_of_the_installed_vllm_is_delegated():
    """kvmux overrides each public method vLLM's base class defines, so no
    hook silently falls back to the base's do-nothing default."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    not_delegated = {"role", "has_connector_metadata"}  # kvmux's own state
    public = {n for n in vars(KVConnectorBase_V1) if not n.startswith("_")} - not_delegated
    owners = {n: next(c for c in KvmuxConnector.__mro__ if n in vars(c)) for n in public}
    assert sorted(n for n, owner in owners.items() if owner is KVConnectorBase_V1) == []


def test_upstream_multiconnector_config_runs_unchanged_under_kvmux():
    """Switching is a one-word change: the same extra config builds both."""
    children = [scripted(), child("ExampleConnector", shared_storage_path="/tmp/kvmux-ex")]
    up = KVConnectorFactory.create_connector(vllm_config(upstream_config(children)), SCHED, _kvc())
    mine = build(children)
    assert len(up.sub_connectors) == len(mine.children)
