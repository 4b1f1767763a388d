"""A hook is written once: the core's table of scheduler hooks
(``kvmux._core.SCHEDULER_HOOKS``, ``hook::SCHEDULER`` in ``rust/mux/mod.rs``)
is what the connector declares, what the Rust ``SchedulerMux`` implements
and what the stub declares; and a built connector's hooks are what its
class declares (no method shadowed by a different body at run time)."""

from __future__ import annotations

import ast
import inspect

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import kvmux._core as core
from kvmux.mux._hooks import AnyChildHook, LayerHook, QuietHook, SchedulerHook, StatsHook
from kvmux.mux.connector import KvmuxConnector
from tests.mux.test_stubs import STUB
from tests.support.harness import NOOP, child, kv_cache_config, mux_config, scripted, vllm_config

TABLE = set(core.SCHEDULER_HOOKS)


def _stub_methods(cls: str) -> set[str]:
    tree = ast.parse(STUB.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {n.name for n in node.body if isinstance(n, ast.FunctionDef)}


def test_the_core_the_stub_and_the_connector_share_one_table_of_scheduler_hooks():
    assert TABLE, "the core exports its table"
    assert TABLE <= set(vars(core.SchedulerMux)), "SchedulerMux implements each"
    assert TABLE <= _stub_methods("SchedulerMux"), "the stub declares each"
    declared = {n for n, v in vars(KvmuxConnector).items() if isinstance(v, SchedulerHook)}
    assert declared <= TABLE, "every SchedulerHook is in the table"
    # The one other builds vLLM's stats object of the Rust answer.
    assert TABLE - declared == {"get_kv_connector_stats"}
    assert isinstance(vars(KvmuxConnector)["get_kv_connector_stats"], StatsHook)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_a_built_connector_keeps_only_what_its_class_declares(role):
    conn = KVConnectorFactory.create_connector(
        vllm_config(mux_config([scripted(), child("NoopConnector", module=NOOP)])),
        role,
        kv_cache_config(),
    )
    hooks = set(core.SCHEDULER_HOOKS) | {"wait_for_layer_load", "save_kv_layer"}
    if role == KVConnectorRole.SCHEDULER:
        # The scheduler's hooks resolve to the Rust multiplexer's methods.
        for hook in core.SCHEDULER_HOOKS:
            if not isinstance(inspect.getattr_static(KvmuxConnector, hook), SchedulerHook):
                continue  # builds vLLM's stats of the Rust answer (checked above)
            got = getattr(conn, hook)
            assert getattr(got, "__self__", None) is conn._scheduler_mux, hook
    else:
        with pytest.raises(RuntimeError, match="scheduler-side hook.*worker role"):
            conn.get_num_new_matched_tokens(None, 0)
    conn.wait_for_layer_load("layer.0")
    # What the instance keeps under a hook's name is only what the class's
    # descriptor resolved (functools.cached_property's way), never a
    # different body.
    for name, value in vars(conn).items():
        if name in hooks or hasattr(KvmuxConnector, name):
            declared = inspect.getattr_static(KvmuxConnector, name)
            assert isinstance(
                declared, SchedulerHook | StatsHook | LayerHook | QuietHook | AnyChildHook
            ), name
            assert value is not None
