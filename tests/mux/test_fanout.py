"""Children whose hooks only return a constant are not called, and their
answers still count exactly as if they had been."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvmux import KvmuxConnector
from tests.support.children import NoopConnector
from tests.support.harness import (
    child,
    kv_cache_config,
    make_request,
    mux_config,
    scripted,
    vllm_config,
)


class FixedMatchConnector(NoopConnector):
    """Always reports 32 matched tokens: a constant, non-zero answer."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 32, False


class InstanceHookConnector(NoopConnector):
    """Sets its lookup on the instance (as wrappers and mocks do): not a
    method kvmux can inspect, so it must always be called."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.get_num_new_matched_tokens = lambda request, n: (16, False)


def build(children):
    cfg = vllm_config(mux_config(children))
    return KvmuxConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_a_constant_answer_still_chooses_the_loading_child():
    fixed = child("FixedMatchConnector", module="tests.mux.test_fanout")
    conn = build([fixed, scripted(matched=48)])
    r = make_request("r", range(100))
    assert conn.get_num_new_matched_tokens(r, 0) == (32, False)
    assert conn.mux_stats()["children"]["FixedMatchConnector"]["hits"] == 1
    # The scripted child has a real body: it is still asked.
    assert conn.children[1].calls == [("lookup", "r")]
    assert conn.active_children("get_num_new_matched_tokens") == (1,)
    conn.request_finished(r, [])
    assert conn.num_live_requests() == 0


def test_hooks_set_on_a_child_instance_are_always_called():
    noop = child("NoopConnector", module="tests.support.children")
    conn = build([noop, child("InstanceHookConnector", module="tests.mux.test_fanout")])
    assert conn.get_num_new_matched_tokens(make_request("r", range(100)), 0) == (16, False)
    assert conn.active_children("get_num_new_matched_tokens") == (1,)
