"""``KvmuxHostCache`` and what vLLM 0.34 changed around it, through vLLM's
real ``Request``, block hasher, scheduler and connector factory (the model
is the stand-in of ``tests.support.harness``, whose KV depends only on the prefix):

- lookahead block hashes (``num_hash_lookahead_tokens`` L > 0, with a
  drafter, when the connector says it supports them): each block's hash
  also covers the L tokens after it and exists only once they do. The tier
  keys blocks by those hashes and never by its token-hash fallback, so a
  block is found only by a request whose block and lookahead tokens are
  equal, and a request too short to have a hash saves and finds nothing;
- ``may_load_async``: the tier loads synchronously, so it answers False;
- vLLM 0.34's default GPU block size, 64: the tier's capacity in slots;
- what else the tier must hold to under 0.34 (and 0.33): a drafter's
  deferred saves, and block hashes finer than its blocks (refused).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.config import KVEventsConfig, VllmConfig
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockStored
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
)
from vllm.v1.request import Request

from kvmux import KvmuxConfigError, KvmuxConnector, KvmuxHostCache, _versions
from kvmux.host_cache.metadata import HostCacheMetadata, SaveJob
from kvmux.host_cache.worker import HostCacheWorker
from kvmux.mux._fanout import constant_answer
from tests.support import harness, sim
from tests.support.harness import (
    BLOCK_SIZE,
    HEAD_SIZE,
    KV_HEADS,
    KVTransferConfig,
    child,
    kv_cache_config,
    layer_names,
    make_kv_caches,
    make_request,
    mux_config,
    upstream_config,
    vllm_config,
)
from tests.support.published import Published

SCHED = KVConnectorRole.SCHEDULER
PREFIX = list(range(500, 548))  # 3 full blocks
HOST = child("KvmuxHostCache", num_blocks=64)
EXAMPLE = child("ExampleConnector", shared_storage_path="/tmp/kvmux-ex")

needs_lookahead = pytest.mark.skipif(
    not _versions.HAS_LOOKAHEAD_HASHES,
    reason="vLLM before 0.34 hashes no lookahead tokens (no supports_lookahead_block_hashes, "
    "no VllmConfig.num_hash_lookahead_tokens)",
)
needs_may_load_async = pytest.mark.skipif(
    not _versions.HAS_MAY_LOAD_ASYNC,
    reason="vLLM before 0.34 never asks may_load_async",
)


def host_cache(**extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KvmuxHostCache",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config=extra or {"num_blocks": 64},
    )


# ------------------------------------------------------ lookahead hashes


class LookaheadSim(harness.SchedulerSim):
    """The tests' scheduler driver with vLLM 0.34's lookahead hashing: its
    requests are hashed by vLLM's block hasher with ``lookahead`` tokens (as
    the engine core builds it from ``num_hash_lookahead_tokens``)."""

    def __init__(self, ktc: Any, lookahead: int, **kw: Any) -> None:
        init_none_hash(sha256)  # deterministic: the same NONE_HASH as sim's
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256, lookahead)
        super().__init__(ktc, **kw)

    def add(self, req_id: str, tokens: Any, *, max_tokens: int = 4, **kw: Any) -> Request:
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(req)
        self.requests[req_id] = req
        return req


@pytest.fixture
def lookahead_sim(monkeypatch):
    """``make(ktc, lookahead, events=False, **kw)``: a :class:`LookaheadSim`
    whose ``VllmConfig`` has ``num_hash_lookahead_tokens = lookahead`` (what
    vLLM 0.34 resolves with a drafter whose connector supports lookahead
    hashes) before the scheduler and the connector read it; ``events``:
    vLLM's KV cache events on, the publisher keeping what it is handed."""

    def make(ktc: Any, lookahead: int, *, events: bool = False, **kw: Any) -> LookaheadSim:
        def config(**fields: Any) -> VllmConfig:
            if events:
                fields["kv_events_config"] = KVEventsConfig(
                    enable_kv_cache_events=True, publisher="null"
                )
            cfg = VllmConfig(**fields)
            cfg.num_hash_lookahead_tokens = lookahead
            return cfg

        monkeypatch.setattr(sim, "VllmConfig", config)
        d = LookaheadSim(ktc, lookahead, **kw)
        assert d.vllm_config.num_hash_lookahead_tokens == lookahead
        assert d.scheduler.num_hash_lookahead_tokens == lookahead
        if events:
            d.published = d.scheduler.kv_event_publisher = Published()
        return d

    return make


@needs_lookahead
def test_the_host_tier_says_its_index_is_right_under_lookahead_hashes():
    """The tier answers True itself; under kvmux (or vLLM's MultiConnector)
    the answer is every child's, so ExampleConnector (vLLM's default, False)
    beside it turns lookahead hashing off."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    # What vLLM's config asks (VllmConfig._resolve_num_hash_lookahead_tokens).
    cls = KVConnectorFactory.get_connector_class(host_cache())
    assert cls is KvmuxHostCache
    assert cls.supports_lookahead_block_hashes(host_cache()) is True
    for children, expected in (([HOST, EXAMPLE], False), ([HOST], True)):
        assert KvmuxConnector.supports_lookahead_block_hashes(mux_config(children)) is expected
        up = upstream_config(children)
        assert MultiConnector.supports_lookahead_block_hashes(up) is expected


@needs_lookahead
@pytest.mark.parametrize("lookahead", [1, 5])
def test_a_block_comes_back_only_for_an_equal_block_and_equal_lookahead_tokens(
    lookahead_sim, lookahead
):
    """A saves its 3 full blocks under vLLM's lookahead hashes. B shares the
    3 blocks and the tokens after them: all 3 load, bit-identical. C shares
    the 3 blocks but not the tokens after the third: only the first 2 (whose
    lookahead tokens lie in the shared prefix) load; the third's KV at its
    last position (a drafter's, in a real engine) depends on what follows."""
    d = lookahead_sim(host_cache(), lookahead)
    tail = [1, 2, 3, 4, 5]  # the 5 tokens after the third block
    a = d.add("A", PREFIX + tail)
    assert len(a.block_hashes) == (len(PREFIX) + len(tail) - lookahead) // BLOCK_SIZE == 3
    d.run()
    assert d.connector.index_stats()["stored"] == 3

    d.scheduler.reset_prefix_cache()  # vLLM's own prefix cache forgets A
    b_tokens = PREFIX + tail + [9] * 11
    b = d.add("B", b_tokens)
    assert b.block_hashes[:3] == a.block_hashes[:3]
    so = d.step()
    assert so.num_scheduled_tokens["B"] == len(b_tokens) - 48  # 48 tokens loaded
    for layer in range(2):
        assert torch.equal(d.device_kv("B", layer, 48), d.expected_kv(PREFIX, layer))
    d.run()

    d.scheduler.reset_prefix_cache()
    c_tokens = PREFIX + [6, 7, 8, 9, 10] + [9] * 11
    c = d.add("C", c_tokens)
    assert c.block_hashes[:2] == a.block_hashes[:2] and c.block_hashes[2] != a.block_hashes[2]
    so = d.step()
    assert so.num_scheduled_tokens["C"] == len(c_tokens) - 32  # only 2 blocks loaded
    for layer in range(2):
        assert torch.equal(d.device_kv("C", layer, len(c_tokens)), d.expected_kv(c_tokens, layer))
    d.run()
    st = d.connector.index_stats()
    assert st["pinned"] == 0 and st["writing"] == 0


@needs_lookahead
def test_a_request_without_a_block_hash_yet_saves_and_finds_nothing(lookahead_sim):
    """With 3 lookahead tokens a request of 16-18 tokens has a full block but
    no hash for it yet: the tier gives it no identity (no token-hash
    fallback, whose key would cover neither the lookahead tokens nor LoRA
    or multimodal inputs), so it saves nothing and a request with the same
    tokens finds nothing."""
    d = lookahead_sim(host_cache(), 3)
    tokens = list(range(100, 118))  # 18 tokens: one full block, no hash
    a = d.add("A", tokens, max_tokens=1)  # ends before the block gets its hash
    assert a.block_hashes == []
    assert d.connector.scheduler.keys(a) == [] and d.connector.scheduler.num_keys(a) == 0
    d.run()
    assert d.connector.index_stats()["stored"] == 0
    d.scheduler.reset_prefix_cache()
    d.add("B", tokens, max_tokens=1)
    assert d.step().num_scheduled_tokens["B"] == len(tokens)  # nothing loaded
    d.run()
    assert d.connector.index_stats()["stored"] == 0


@needs_lookahead
def test_a_block_is_saved_once_its_lookahead_tokens_exist(lookahead_sim):
    """An 18-token prompt's block gets its hash (3 lookahead tokens) once the
    first generated token exists; the tier saves it at the next step, under
    that hash, and a request with the same 19 tokens loads it back."""
    d = lookahead_sim(host_cache(), 3)
    a = d.add("A", list(range(200, 218)), max_tokens=3)
    d.step()  # the prefill: no hash yet, nothing saved
    assert d.connector.index_stats()["writing"] + d.connector.index_stats()["stored"] == 0
    assert len(a.block_hashes) == 1  # the generated token completes the lookahead
    d.run()
    assert d.connector.index_stats()["stored"] == 1
    assert d.connector.scheduler.index.longest_prefix(a.block_hashes) == 1
    d.scheduler.reset_prefix_cache()
    b_tokens = a.all_token_ids[:19] + [1] * 5
    d.add("B", b_tokens)
    assert d.step().num_scheduled_tokens["B"] == len(b_tokens) - 16
    for layer in range(2):
        assert torch.equal(d.device_kv("B", layer, 16), d.expected_kv(b_tokens[:16], layer))
    d.run()


@needs_lookahead
def test_the_tiers_events_say_what_vllms_say_of_the_same_blocks_under_lookahead(lookahead_sim):
    """With KV cache events on, the tier's ``BlockStored`` carry, for each
    block, the hash, extra keys and ``lookahead_token_ids`` vLLM's own GPU
    events carry for it."""
    d = lookahead_sim(host_cache(), 2, events=True)
    d.add("A", PREFIX + [1, 2, 3, 4, 5], max_tokens=16)  # 69 tokens: 4 blocks hashed
    d.run()

    def by_hash(events: list[Any]) -> dict[Any, tuple[Any, Any]]:
        out = {}
        for e in events:
            if isinstance(e, BlockStored):
                for i, h in enumerate(e.block_hashes):
                    extra = e.extra_keys[i] if e.extra_keys else None
                    out[h] = (extra, e.lookahead_token_ids[i])
        return out

    gpu = by_hash(d.published.events(MEDIUM_GPU))
    cpu = by_hash(d.published.events(MEDIUM_CPU))
    assert len(cpu) == d.connector.index_stats()["stored"] == 4
    assert cpu == {h: gpu[h] for h in cpu}
    assert all(len(ahead) == 2 for _, ahead in cpu.values())


# ------------------------------------------------------------ may_load_async


@needs_may_load_async
def test_the_host_tier_never_asks_for_an_async_load():
    """Its loads are synchronous: False even for a request with
    ``do_remote_prefill``, where vLLM's default says True; a constant, so
    kvmux never calls it (it runs on every enqueue)."""
    tier = KvmuxHostCache(vllm_config(host_cache()), SCHED, kv_cache_config())
    remote = make_request("r", range(40), kv_transfer_params={"do_remote_prefill": True})
    assert KVConnectorBase_V1.may_load_async(tier, remote) is True
    assert tier.may_load_async(remote) is False
    assert tier.may_load_async(make_request("s", range(40))) is False
    assert constant_answer(tier.may_load_async) == (True, False)


@needs_may_load_async
@pytest.mark.parametrize("children", [[HOST, EXAMPLE], [HOST]], ids=["host+example", "host"])
@pytest.mark.parametrize(
    "params", [None, {"do_remote_prefill": True}, {"other": 1}], ids=["none", "remote", "other"]
)
def test_may_load_async_under_kvmux_is_multiconnectors_over_the_same_children(children, params):
    """kvmux and vLLM's MultiConnector (built by vLLM's factory over the
    same children) agree for every request: True only where ExampleConnector
    (vLLM's P/D default) may load it asynchronously, a ``do_remote_prefill``
    request. They agree for the host tier alone too, since MultiConnector
    asks each child and the tier answers False itself; before the tier had
    its own answer it inherited vLLM's default, and both said True for a
    ``do_remote_prefill`` request no child would load asynchronously. Under
    kvmux the tier is never asked."""
    mine = KVConnectorFactory.create_connector(
        vllm_config(mux_config(children)), SCHED, kv_cache_config()
    )
    theirs = KVConnectorFactory.create_connector(
        vllm_config(upstream_config(children)), SCHED, kv_cache_config()
    )
    assert type(mine) is KvmuxConnector
    req = make_request("r", range(40), kv_transfer_params=params)
    expected = EXAMPLE in children and bool(params and params.get("do_remote_prefill"))
    assert mine.may_load_async(req) is theirs.may_load_async(req) is expected
    assert 0 not in mine.active_children("may_load_async")


# ------------------------------------------- a drafter's deferred saves


def test_a_save_dropped_for_a_failed_load_before_the_saves_run_is_never_copied():
    """vLLM 0.34 with a drafter collects a step's load errors and worker
    metadata before the step's saves run (``wait_for_save`` after the
    drafter). A save of a block whose load failed is reported failed then
    (the scheduler frees its slot at once), so the copy must skip it: the
    slot is never written nor reported saved later."""
    kv = make_kv_caches(seed=1)
    w = HostCacheWorker(sim.NUM_BLOCKS, 8, _page_bytes(BLOCK_SIZE) * len(kv))
    w.register_kv_caches(kv)
    w.bind_connector_metadata(HostCacheMetadata(saves=[SaveJob("A", (5, 6), (2, 3))]))
    assert w.discard_saves_from({6}) == 1  # vLLM's order with a drafter
    out = w.build_connector_worker_meta()
    assert out is not None and set(out.failed_saves) == {3} and not out.saved
    w.wait_for_save()  # after the drafter
    w.clear_connector_metadata()
    w.shutdown()
    out = w.build_connector_worker_meta()
    assert out is not None and set(out.saved) == {2} and not out.failed_saves
    host, device = w.pool.layers[0].host, kv[layer_names()[0]]
    assert torch.equal(host[2], device[5])
    assert not torch.equal(host[3], device[6])


# ------------------------------------------------- hashes finer than blocks


def test_block_hashes_finer_than_the_tiers_blocks_are_refused_with_the_fix():
    """A hybrid model with ``prefix_match_unit`` below its block size: vLLM
    hashes every ``prefix_match_unit`` tokens, so its i-th hash names a
    shorter prefix than the tier's i-th block, and a request sharing only
    that much would load another prompt's KV. Refused, naming the fix; the
    hash granularity vLLM resolves by default (the block size) runs."""
    cfg = vllm_config(host_cache())
    finer = harness.hybrid_kv_cache_config()
    finer.hash_block_size = BLOCK_SIZE // 2
    with pytest.raises(KvmuxConfigError, match="prefix_match_unit") as err:
        KvmuxHostCache(cfg, SCHED, finer)
    assert f"set it to {BLOCK_SIZE}" in str(err.value)
    same = harness.hybrid_kv_cache_config()
    same.hash_block_size = BLOCK_SIZE
    KvmuxHostCache(cfg, SCHED, same)


# ------------------------------------------------------------------ capacity


def _page_bytes(block_size: int) -> int:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    ).page_size_bytes


@pytest.mark.parametrize("capacity_gib", [0.01, 0.3])
def test_capacity_gib_in_slots_at_vllm_034s_default_block_size_64(capacity_gib):
    """vLLM 0.34's GPU default block is 64 tokens (16 before): a slot holds
    4x the bytes, so the same ``capacity_gib`` is a quarter of the slots,
    ``capacity_gib * 2**30 // slot_bytes`` on both sides."""
    tiers = {}
    for bs in (16, 64):
        cfg = vllm_config(host_cache(capacity_gib=capacity_gib))
        cfg.cache_config.block_size = bs
        tiers[bs] = {
            role: KvmuxHostCache(cfg, role, sim.kv_cache_config(32, block_size=bs))
            for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
        }
    slot16 = tiers[16][SCHED].layout.slot_bytes
    slot64 = tiers[64][SCHED].layout.slot_bytes
    assert slot16 == _page_bytes(16) * len(layer_names())
    assert slot64 == 4 * slot16
    for bs, slot in ((16, slot16), (64, slot64)):
        slots = int(capacity_gib * 2**30 // slot)
        assert tiers[bs][SCHED].index_stats()["capacity"] == slots
        assert tiers[bs][KVConnectorRole.WORKER].worker.num_slots == slots
    assert tiers[64][SCHED].layout.block_size == 64
