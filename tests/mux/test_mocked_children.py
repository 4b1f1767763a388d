"""Drop-in for code that builds children as vLLM's tests do: a child class
whose ``__new__`` hands back ``MagicMock(spec_set=KVConnectorBase_V1)``
(``scripted.MockedConnector``). kvmux cannot read such a child's hooks from
its class, so it treats every hook as active and calls it on the object,
exactly as vLLM's ``MultiConnector`` does; an error names the child."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks

from kvmux import KvmuxChildError, KvmuxConnector
from kvmux._versions import HAS_TRANSFER_RESULTS, TransferResults
from tests.support.harness import (
    child,
    kv_cache_config,
    make_request,
    mux_config,
    upstream_config,
    vllm_config,
)
from tests.support.scripted import MOCKS

MOCKED = child("MockedConnector", module="tests.support.scripted")
SCRIPTED = child("ScriptedConnector", module="tests.support.scripted", params={"s": 1})


def build(role: KVConnectorRole, upstream: bool = False, **extra):
    children = [MOCKED, SCRIPTED]
    ktc = upstream_config(children) if upstream else mux_config(children, **extra)
    conn = KVConnectorFactory.create_connector(vllm_config(ktc), role, kv_cache_config())
    mock = MOCKS[-1]
    mock.get_num_new_matched_tokens.return_value = (32, False)
    mock.request_finished.return_value = (False, {"m": 2})
    mock.build_connector_meta.return_value = KVConnectorMetadata()
    mock.get_finished.return_value = (None, None)
    mock.get_block_ids_with_load_errors.return_value = set()
    mock.build_connector_worker_meta.return_value = None
    if HAS_TRANSFER_RESULTS:
        mock.get_transfer_results.return_value = TransferResults()
    return conn, mock


def scheduler_lifecycle(conn) -> tuple:
    r = make_request("r", range(64))
    blocks = KVCacheBlocks(blocks=([],))
    lookup = conn.get_num_new_matched_tokens(r, 0)
    conn.update_state_after_alloc(r, blocks, 32)
    meta = conn.build_connector_meta(None)
    finish = conn.request_finished(r, [1, 2, 3, 4])
    return r, blocks, lookup, meta, finish


def test_a_mocked_child_is_called_on_the_object_as_multiconnector_does():
    ours, mock = build(KVConnectorRole.SCHEDULER)
    assert type(ours) is KvmuxConnector
    r, blocks, lookup, _, finish = scheduler_lifecycle(ours)
    assert lookup == (32, False)
    mock.update_state_after_alloc.assert_called_once_with(r, blocks, 32)
    assert finish == (False, {"m": 2, "s": 1})
    mock.request_finished.assert_called_once_with(r, [1, 2, 3, 4])

    theirs, their_mock = build(KVConnectorRole.SCHEDULER, upstream=True)
    assert type(theirs).__name__ == "MultiConnector"
    r2, blocks2, lookup2, _, _ = scheduler_lifecycle(theirs)
    assert lookup2 == lookup
    their_mock.update_state_after_alloc.assert_called_once_with(r2, blocks2, 32)
    assert [c[0] for c in mock.method_calls] == [c[0] for c in their_mock.method_calls]


def test_a_mocked_child_gets_every_worker_hook_the_per_layer_ones_included():
    conn, mock = build(KVConnectorRole.WORKER)
    sched, _ = build(KVConnectorRole.SCHEDULER)
    scheduler_lifecycle(sched)
    conn.bind_connector_metadata(sched.build_connector_meta(None))
    conn.start_load_kv(None)
    conn.wait_for_layer_load("layer.0")
    conn.save_kv_layer("layer.0", "kv", "attn")
    conn.wait_for_save()
    conn.get_finished(set())
    conn.clear_connector_metadata()
    called = {c[0] for c in mock.method_calls}
    for hook in (
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "clear_connector_metadata",
    ):
        assert hook in called, hook
    mock.wait_for_layer_load.assert_called_once_with("layer.0")
    mock.save_kv_layer.assert_called_once_with("layer.0", "kv", "attn")


@pytest.mark.parametrize(
    ("hook", "call"),
    [
        ("get_num_new_matched_tokens", lambda c, r: c.get_num_new_matched_tokens(r, 0)),
        # after a lookup: the child took part, so its failure is not contained
        (
            "request_finished",
            lambda c, r: c.get_num_new_matched_tokens(r, 0) and c.request_finished(r, [1]),
        ),
        ("start_load_kv", lambda c, r: c.start_load_kv(None)),
    ],
)
def test_an_error_in_a_mocked_child_names_it(hook, call):
    role = KVConnectorRole.WORKER if hook == "start_load_kv" else KVConnectorRole.SCHEDULER
    # Without a breaker: with one, a raising lookup is a contained miss.
    conn, mock = build(role, breaker_failures=None)
    getattr(mock, hook).side_effect = RuntimeError("boom")
    if hook == "request_finished":
        mock.get_num_new_matched_tokens.side_effect = None
    with pytest.raises(KvmuxChildError) as err:
        call(conn, make_request("r", range(64)))
    assert err.value.child == "MockedConnector" and err.value.hook == hook
    assert "boom" in str(err.value)


def test_a_mocked_child_s_malformed_answer_is_refused_naming_it():
    conn, mock = build(KVConnectorRole.SCHEDULER)
    mock.get_num_new_matched_tokens.return_value = "plenty"
    with pytest.raises(KvmuxChildError, match="MockedConnector"):
        conn.get_num_new_matched_tokens(make_request("r", range(64)), 0)
    assert conn.num_live_requests() == 0
