"""``KvmuxHostCache`` with vLLM's real scheduler and real CPU tensors as the
paged KV cache (``tests.support.harness``: the model is the one stand-in; its "attention"
writes KV that depends only on the prefix, as real KV does)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from kvmux import KvmuxConfigError, KvmuxHostCache
from kvmux._core import HostIndex
from kvmux.host_cache.metadata import HostCacheWorkerMetadata
from kvmux.host_cache.scheduler import HostCacheScheduler
from kvmux.host_cache.transfer import HostPool, UnsupportedKVLayout, contiguous_runs
from tests.support.harness import (
    BLOCK_SIZE,
    KVTransferConfig,
    fake_model_output,
    mux_config,
    scripted,
)
from tests.support.sim import make_request

PREFIX = list(range(500, 548))  # 3 full blocks


def host_cache(**extra):
    return KVTransferConfig(
        kv_connector="KvmuxHostCache",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config=extra or {"num_blocks": 64},
    )


def host_child(**extra):
    return {
        "kv_connector": "KvmuxHostCache",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra or {"num_blocks": 64},
    }


def assert_clean(d, index_stats):
    st = index_stats()
    assert st["pinned"] == 0 and st["writing"] == 0
    assert st["ready"] + st["free"] == st["capacity"]


# ------------------------------------------------------------ round trip


def test_prefix_comes_back_bit_identical_into_other_device_blocks(driver_factory):
    d = driver_factory(host_cache())
    d.add("A", PREFIX + [1, 2, 3, 4, 5])
    d.run()
    d.scheduler.reset_prefix_cache()  # vLLM's own prefix cache forgets A
    b = d.add("B", PREFIX + [9] * 17)
    d.step()
    assert b.num_computed_tokens == len(PREFIX) + 17  # 48 loaded, 17 computed
    ids_b = d.scheduler.kv_cache_manager.get_block_ids("B")[0][:3]
    for layer in range(2):
        assert torch.equal(d.device_kv("B", layer, len(PREFIX)), d.expected_kv(PREFIX, layer))
    assert d.connector.index_stats()["stored"] >= 3
    d.run()
    assert_clean(d, d.connector.index_stats)
    assert len(set(ids_b)) == 3


def test_a_partly_shared_prefix_loads_exactly_the_shared_full_blocks(driver_factory):
    d = driver_factory(host_cache())
    d.add("A", PREFIX + [1] * 20)
    d.run()
    d.scheduler.reset_prefix_cache()
    # Shares 2 full blocks and 5 tokens of the third.
    tokens = PREFIX[:37] + [7] * 30
    d.add("B", tokens)
    so = d.step()
    assert so.num_scheduled_tokens["B"] == len(tokens) - 32
    for layer in range(2):
        assert torch.equal(d.device_kv("B", layer, len(tokens)), d.expected_kv(tokens, layer))
    d.run()


def test_partial_blocks_are_never_stored(driver_factory):
    d = driver_factory(host_cache(), write_kv=False)
    d.add("A", list(range(40)), max_tokens=1)  # 2 full blocks + 8 tokens
    d.run()
    assert d.connector.index_stats()["stored"] == 2


def test_without_vllm_block_hashes_a_chained_token_hash_finds_the_prefix(driver_factory):
    d = driver_factory(host_cache(), prefix_caching=False)
    d.add("A", PREFIX + [1, 2], hashed=False)
    d.run()
    req = d.add("B", PREFIX + [3, 4, 5], hashed=False)
    assert req.block_hashes == []
    so = d.step()
    assert so.num_scheduled_tokens["B"] == 3
    assert torch.equal(d.device_kv("B", 1, 48), d.expected_kv(PREFIX, 1))


# ------------------------------------------------------ capacity and pins


def test_eviction_under_pressure_never_exceeds_capacity(driver_factory):
    d = driver_factory(host_cache(num_blocks=6), write_kv=False)
    for i in range(8):
        d.add(f"r{i}", [1000 * i + t for t in range(48)], max_tokens=1)
        d.run()
        st = d.connector.index_stats()
        assert st["ready"] + st["writing"] <= 6
    st = d.connector.index_stats()
    assert st["evicted"] >= 8 * 3 - 6
    # The most recent prompts are still cached, the oldest are gone.
    keys = d.connector.scheduler.keys
    last = d.add("again7", [7000 + t for t in range(48)] + [1])
    first = d.add("again0", list(range(48)) + [1])
    assert d.connector.scheduler.index.longest_prefix(keys(last)) == 3
    assert d.connector.scheduler.index.longest_prefix(keys(first)) == 0


def test_pinned_slots_survive_eviction():
    ix = HostIndex(3)
    keys = [bytes([i]) * 16 for i in range(6)]
    slots = ix.reserve(keys[:3]).slots
    ix.commit(slots)
    pinned = ix.pin_ready(keys[:1])
    got = ix.reserve(keys[3:6]).slots  # wants 3 slots, only 2 evictable
    assert len(got) == 2
    assert ix.longest_prefix(keys[:1]) == 1
    ix.check()
    ix.abort(got)
    ix.unpin(pinned)
    assert ix.stats()["pinned"] == 0


def test_the_index_reports_what_it_stores_and_evicts_with_each_saves_owner():
    """Saves complete once every worker acknowledged them; the index's events
    say what became readable (with the request that saved it) and what left,
    and a request id that is not valid UTF-8 comes back as it went in."""
    ix = HostIndex(2, workers=2)
    keys = [bytes([i]) * 16 for i in range(3)]
    owner = "req\ud800"
    slots = ix.reserve(keys[:2], 0, owner).slots
    assert ix.saving(owner) == 2
    assert ix.ack_saves({slots[0]: 1, slots[1]: 2}) == 1  # one worker of two for the first
    assert ix.ack_saves({slots[0]: 1}) == 1
    assert ix.saving(owner) == 0
    # The next reservation evicts the least recent, keys[1]; it hands back
    # everything since the last drain, its eviction last.
    got = ix.reserve(keys[2:], 0, "other")
    assert got.events == [
        ("stored", 0, keys[1], owner),
        ("stored", 0, keys[0], owner),
        ("evicted", 0, keys[1], None),
    ]
    assert ix.take_events() == []
    # The workers' report of a step, in one call: the failed save aborted.
    assert ix.workers_reported(got.slots, {}, {}) == [("aborted", 0, keys[2], "other")]
    ix.check()


def test_a_save_is_readable_once_every_worker_confirmed_it():
    """With two workers a block becomes readable, and counts as stored, only
    once both confirmed its copy; until then its request's saves are in
    flight (an async save when it finishes)."""
    sched = HostCacheScheduler(BLOCK_SIZE, num_slots=8, num_workers=2)
    req = make_request("A", PREFIX + [1])
    sched.get_num_new_matched_tokens(req, 0)
    step = SimpleNamespace(num_scheduled_tokens={"A": len(PREFIX) + 1})
    blocks = SimpleNamespace(get_block_ids=lambda req_id: ([1, 2, 3, 4],))
    slots = [s for job in sched.build_connector_meta(step, blocks).saves for s in job.slots]
    assert len(slots) == 3
    sched.update_connector_output(HostCacheWorkerMetadata(saved=Counter(slots)))  # one worker
    assert sched.index.longest_prefix(sched.keys(req)) == 0
    assert sched.request_finished(req) == (True, None)
    sched.update_connector_output(HostCacheWorkerMetadata(saved=Counter(slots)))  # the other
    assert sched.index.longest_prefix(sched.keys(req)) == 3
    stats = sched.take_stats()
    assert stats is not None and stats.data["stored_blocks"] == 3
    sched.index.check()


def test_a_load_in_flight_pins_its_slots_until_the_worker_confirms(driver_factory):
    d = driver_factory(host_cache(num_blocks=4), write_kv=False)
    d.add("A", PREFIX + [1], max_tokens=1)
    d.run()
    d.scheduler.reset_prefix_cache()
    d.add("B", PREFIX + [2])
    so = d.scheduler.schedule()  # plans B's load: its 3 slots are pinned now
    assert d.connector.index_stats()["pinned"] == 3
    got = d.connector.scheduler.index.reserve([b"x" * 16, b"y" * 16])
    assert (got.positions, got.slots) == ([0], [3])
    d.scheduler.update_from_output(so, fake_model_output(so))  # the worker never ran
    assert d.connector.index_stats()["pinned"] == 4  # still pinned (3 + the reservation)


# --------------------------------------------------- abort / preemption


def test_abort_in_the_middle_of_a_load_leaves_nothing_pinned(driver_factory):
    d = driver_factory(host_cache())
    d.add("A", PREFIX + [1])
    d.run()
    d.scheduler.reset_prefix_cache()
    d.add("B", PREFIX + [2, 3])
    real_schedule = d.scheduler.schedule

    def schedule_then_abort():
        so = real_schedule()
        d.scheduler.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
        return so

    d.scheduler.schedule = schedule_then_abort
    d.step()
    d.scheduler.schedule = real_schedule
    d.run()
    assert_clean(d, d.connector.index_stats)
    assert d.connector.num_live_requests() == 0


def test_abort_while_a_save_is_in_flight_frees_the_blocks_only_after_it(driver_factory):
    d = driver_factory(host_cache())
    d.add("A", PREFIX + [1], max_tokens=50)
    d.step()  # prefill: 3 blocks saved this step
    d.scheduler.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    d.run()
    assert_clean(d, d.connector.index_stats)
    assert d.connector.index_stats()["ready"] == 3
    assert d.connector.num_live_requests() == 0
    assert "A" not in d.scheduler.requests


def test_preemption_mid_save_and_load_leaks_nothing(driver_factory):
    d = driver_factory(host_cache(num_blocks=32), num_blocks=14, max_num_seqs=4)
    for i in range(6):
        d.add(f"p{i}", PREFIX[: 16 * (1 + i % 3)] + [i] * 20, max_tokens=40)
    preempted = 0
    for _ in range(400):
        if not d.scheduler.requests:
            break
        so = d.step()
        preempted += len(so.preempted_req_ids or ())
    assert preempted > 0, "the workload did not preempt; shrink num_blocks"
    assert set(d.finished) == {f"p{i}" for i in range(6)}
    assert_clean(d, d.connector.index_stats)
    assert d.connector.num_live_requests() == 0


# ------------------------------------------------------------ under kvmux


def test_works_as_a_child_of_kvmux_beside_another_child(driver_factory):
    d = driver_factory(mux_config([host_child(), scripted(params={"pd": "ok"})]))
    d.add("A", PREFIX + [1])
    d.run()
    d.scheduler.reset_prefix_cache()
    d.add(
        "B",
        PREFIX + [2] * 3,
        kv_transfer_params={"num_extra_cached_tokens": True, "host_cache_stats": True},
    )
    d.step()
    assert torch.equal(d.device_kv("B", 0, 48), d.expected_kv(PREFIX, 0))
    d.run()
    assert d.finished["B"] == {
        "pd": "ok",
        "host_cache_stats": {"loaded_tokens": 48, "saved_blocks": 0},
        "num_extra_cached_tokens": 48,
    }
    stats = d.connector.mux_stats()["children"]["KvmuxHostCache"]
    assert stats["loads"] == 1 and stats["load_tokens"] == 48
    host = d.connector.children[0]
    assert_clean(d, host.index_stats)


def test_stats_reach_vllms_stats_path(driver_factory):
    d = driver_factory(host_cache())
    d.add("A", PREFIX + [1])
    d.run()
    d.scheduler.reset_prefix_cache()
    d.add("B", PREFIX + [2])
    d.run()
    total: dict[str, int] = {}
    for snap in d.kv_stats:
        for k, v in snap.items():
            total[k] = total.get(k, 0) + v
    block = 2 * 2 * BLOCK_SIZE * 2 * 32 * 4  # layers * heads * positions * 2*head * fp32
    assert total["lookups"] >= 2
    assert total["lookup_hit_tokens"] >= 48 and total["loaded_tokens"] == 48
    assert total["stored_blocks"] == 3
    assert total["bytes_loaded"] == 3 * block
    assert total["bytes_saved"] == 3 * block


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({}, ["capacity_gib", "num_blocks"]),
        ({"capacity_gib": 1, "num_blocks": 4}, ["not both"]),
        ({"capacity_gib": -1}, ["capacity_gib", "positive"]),
        ({"capacity_gib": "8"}, ["capacity_gib"]),
        ({"num_blocks": 0}, ["num_blocks", "positive"]),
        ({"num_blocks": 2.5}, ["num_blocks"]),
        ({"num_blocks": 4, "cap": 1}, ["'cap'"]),
        ({"capacity_gib": 1e-9}, ["holds no KV block"]),
    ],
)
def test_bad_capacity_is_refused_with_the_fix(h, extra, words):
    cfg = h.vllm_config(
        KVTransferConfig(
            kv_connector="KvmuxHostCache",
            kv_connector_module_path="kvmux",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    )
    with pytest.raises(KvmuxConfigError) as err:
        KvmuxHostCache(cfg, KVConnectorRole.SCHEDULER, h.kv_cache_config())
    for w in words:
        assert w in str(err.value)


def test_capacity_gib_sizes_the_pool(h):
    cfg = h.vllm_config(host_cache(capacity_gib=0.001))
    conn = KvmuxHostCache(cfg, KVConnectorRole.SCHEDULER, h.kv_cache_config())
    block = 2 * 2 * BLOCK_SIZE * 64 * 4
    assert conn.index_stats()["capacity"] == int(0.001 * (1 << 30)) // block


# ---------------------------------------------------------- the copy path


COPIES = {"index_select", "index_copy_", "copy_", "index", "index_put_", "clone", "cat"}


def _count_ops(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            seen[name] = seen.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return seen


def test_copies_are_one_batched_op_per_layer_per_direction():
    layers = {f"l{i}": torch.randn(32, 2, 16, 64) for i in range(4)}
    pool = HostPool(layers, num_blocks=32, num_slots=16)
    blocks = [5, 1, 9, 30, 2, 7]
    ops = _count_ops(lambda: pool.save(blocks, [3, 4, 5, 6, 7, 8]))
    # One gather per layer, straight into the host slots: no other copy.
    assert ops.get("index_select") == 4 and not ops.keys() & COPIES - {"index_select"}
    for i, b in enumerate(blocks):
        assert torch.equal(pool.layers[2].host[3 + i], layers["l2"][b])
    for t in layers.values():
        t.zero_()
    ops = _count_ops(lambda: pool.load([3, 4, 5, 6, 7, 8], [0, 11, 12, 13, 14, 31]))
    # The scatter is NumPy's row assignment over the same memory, one per
    # layer (torch's index_copy_ was slower, P4): no torch copy, no staging.
    assert not ops.keys() & COPIES
    for name, t in layers.items():
        for i, b in enumerate([0, 11, 12, 13, 14, 31]):
            assert torch.equal(t[b], pool.layers[int(name[1:])].host[3 + i])
    # Fragmented slots are still one gather/scatter per layer (plus a copy per run).
    ops = _count_ops(lambda: pool.save([1, 2, 3], [0, 10, 11]))
    assert ops.get("index_select") == 4


def test_kv_first_layouts_round_trip_and_odd_ones_are_refused():
    kv = {"a": torch.randn(2, 20, 16, 2, 8), "b": torch.randn(2, 20, 16, 2, 8)}
    pool = HostPool(kv, num_blocks=20, num_slots=8)
    want = kv["b"][:, [4, 6]].clone()
    pool.save([4, 6], [0, 5])
    kv["b"].zero_()
    pool.load([0, 5], [10, 11])
    assert torch.equal(kv["b"][:, [10, 11]], want)
    with pytest.raises(UnsupportedKVLayout, match="blocks-first"):
        HostPool({"x": torch.zeros(16, 20, 3)}, num_blocks=20, num_slots=4)


def test_layers_sharing_one_tensor_are_copied_once():
    shared = torch.randn(10, 2, 4, 8)
    pool = HostPool({"a": shared, "b": shared}, num_blocks=10, num_slots=4)
    assert len(pool.layers) == 1


def test_contiguous_runs():
    assert contiguous_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert contiguous_runs([]) == []
