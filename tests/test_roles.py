"""A hook called on the side a connector was not built for: both kvmux
connectors refuse it with one wording (``kvmux.roles``) that names the hook,
the connector, its role and where the hook belongs."""

from __future__ import annotations

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tests.support import harness

SCHEDULER, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER


def _mux(role):
    cfg = harness.vllm_config(harness.mux_config([harness.scripted(), harness.scripted()]))
    return KVConnectorFactory.create_connector(cfg, role, harness.kv_cache_config())


def _host(role):
    ktc = KVTransferConfig(
        kv_connector="KvmuxHostCache",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={"num_blocks": 64},
    )
    return KVConnectorFactory.create_connector(
        harness.vllm_config(ktc), role, harness.kv_cache_config()
    )


@pytest.mark.parametrize(("build", "name"), [(_mux, "KvmuxConnector"), (_host, "KvmuxHostCache")])
def test_a_scheduler_hook_on_a_worker_connector_names_the_hook_and_the_fix(build, name):
    conn = build(WORKER)
    request = harness.make_request("r", range(32))
    with pytest.raises(RuntimeError) as err:
        conn.get_num_new_matched_tokens(request, 0)
    assert str(err.value) == (
        f"kvmux: get_num_new_matched_tokens is a scheduler-side hook, and this {name} "
        "was built for the worker role; call it on the scheduler's connector"
    )


@pytest.mark.parametrize(("build", "name"), [(_mux, "KvmuxConnector"), (_host, "KvmuxHostCache")])
def test_a_worker_hook_on_the_scheduler_connector_names_the_hook_and_the_fix(build, name):
    conn = build(SCHEDULER)
    with pytest.raises(RuntimeError) as err:
        conn.get_block_ids_with_load_errors()
    assert str(err.value) == (
        f"kvmux: get_block_ids_with_load_errors is a worker-side hook, and this {name} "
        "was built for the scheduler role; call it on a worker's connector"
    )
