"""Failed loads reported by the workers stop counting as supplied tokens:
the scheduler-side connector maps vLLM's ``invalid_block_ids`` and
``failed_recving`` back to the requests whose load they hit (the rule is in
``rust/mux/scheduler/load_errors.rs``, ``SchedulerMux::load_errors``; here
through the real connector and vLLM's ``Request`` and ``KVConnectorOutput``)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput

from kvmux import KvmuxConnector
from tests.support.harness import kv_cache_config, make_request, mux_config, scripted, vllm_config

EXTRA = "num_extra_cached_tokens"


class Blocks:
    """vLLM's ``KVCacheBlocks`` as far as ``get_block_ids`` goes."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.groups


def planned_load(local: int, external: int, block_ids: list[int]):
    """A connector whose second child loads ``external`` tokens after
    ``local`` ones into ``block_ids`` (block size 16)."""
    conn = KvmuxConnector(
        vllm_config(mux_config([scripted(), scripted(matched=local + external)])),
        KVConnectorRole.SCHEDULER,
        kv_cache_config(),
    )
    req = make_request("r", range(local + external + 20), kv_transfer_params={EXTRA: True})
    assert conn.get_num_new_matched_tokens(req, local) == (external, False)
    conn.update_state_after_alloc(req, Blocks(block_ids), external)
    return conn, req


def report(conn, invalid=(), failed=()):
    conn.update_connector_output(
        KVConnectorOutput(invalid_block_ids=set(invalid), failed_recving=set(failed))
    )


def extra_tokens(conn, req) -> int:
    return conn.request_finished(req, [])[1][EXTRA]


def test_tokens_from_the_first_invalid_block_on_are_not_counted():
    # 16 local tokens (block 10), 48 loaded (blocks 11, 12, 13); block 12 fails.
    conn, req = planned_load(16, 48, [10, 11, 12, 13, 14])
    report(conn, invalid={12, 99})
    report(conn, invalid={11})  # reported once: a later error is a new load's
    assert extra_tokens(conn, req) == 16


def test_a_failed_receive_loses_the_whole_load_once():
    conn, req = planned_load(0, 32, [3, 4, 5])
    report(conn, failed={"r"})
    report(conn, invalid={3}, failed={"r"})  # reported again: already accounted for
    assert extra_tokens(conn, req) == 0


def test_errors_in_other_blocks_leave_the_load_alone():
    conn, req = planned_load(16, 32, [10, 11, 12, 13])
    report(conn, invalid={10, 13, 50})  # the local block and one past the load
    assert extra_tokens(conn, req) == 32
