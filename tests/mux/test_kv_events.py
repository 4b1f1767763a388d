"""KV cache events from every tier, through vLLM's real scheduler: what
vLLM's KV event publisher is handed each step (its own GPU events and the
connector's ``take_events``), each batch round-tripped through vLLM's wire
format (msgpack, ``KVEventBatch``).

- ``KvmuxHostCache`` reports ``BlockStored`` for the blocks it holds and
  ``BlockRemoved`` for those it evicts or drops, ``medium="CPU"``, with the
  block hashes vLLM's own GPU events carry for the same prefix;
- under ``KvmuxConnector`` every child's events (scheduler side and worker
  side) are published, each labelled with its child in ``ownership``, each
  child's worker events aggregated across workers as that child does alone,
  and repeats that say nothing new published once.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import pytest
from vllm.config import KVEventsConfig, VllmConfig
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)

from kvmux.mux.events import deduplicated
from tests.support import sim
from tests.support.harness import BLOCK_SIZE, KVTransferConfig, child, mux_config
from tests.support.published import Published

# A later child must save what it sees once (vLLM's rule): see conftest.
pytestmark = pytest.mark.usefixtures("every_child_saves")

PREFIX = list(range(500, 548))  # 3 full blocks
EVENTS = "tests.support.event_children"


@pytest.fixture
def events_sim(driver_factory, monkeypatch):
    """``driver_factory`` with vLLM's KV cache events on; the scheduler's
    publisher keeps what it is handed (``d.published``)."""
    on = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    monkeypatch.setattr(sim, "VllmConfig", functools.partial(VllmConfig, kv_events_config=on))

    def make(ktc: Any, **kw: Any) -> Any:
        d = driver_factory(ktc, **kw)
        d.published = d.scheduler.kv_event_publisher = Published()
        return d

    return make


def host_cache(num_blocks: int = 64) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KvmuxHostCache",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={"num_blocks": num_blocks},
    )


def host_child(num_blocks: int = 64) -> dict[str, Any]:
    return child("KvmuxHostCache", num_blocks=num_blocks)


def per_block(events: list[Any]) -> list[tuple[Any, Any, tuple[int, ...]]]:
    """(hash, parent hash, token ids) of every block the ``BlockStored``
    events announce, in order."""
    out = []
    for e in events:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            out.append((h, parent, tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])))
            parent = h
    return out


def hashes(events: list[Any]) -> list[Any]:
    return [h for e in events for h in e.block_hashes]


# ------------------------------------------------------------ host tier


def test_the_host_tier_announces_what_it_stores_with_the_cpu_medium_and_vllms_hashes(
    events_sim,
):
    d = events_sim(host_cache())
    d.add("A", PREFIX + [1, 2, 3, 4, 5], max_tokens=12)  # 53 + 12 tokens: 4 full blocks
    d.run()
    gpu = [e for e in d.published.events(MEDIUM_GPU) if isinstance(e, BlockStored)]
    cpu = d.published.events(MEDIUM_CPU)
    assert cpu and all(isinstance(e, BlockStored) for e in cpu)
    # The same blocks as vLLM's own, with the same hash, parent and tokens.
    assert per_block(cpu) == per_block(gpu)
    assert len(per_block(cpu)) == 4 == d.connector.index_stats()["stored"]
    for e in cpu:
        assert e.block_size == BLOCK_SIZE and e.locality == "LOCAL" and e.ownership is None
        assert e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention"


def test_an_evicted_block_is_announced_removed_from_the_cpu_tier(events_sim):
    d = events_sim(host_cache(num_blocks=6), write_kv=False)
    prompts = [[1000 * i + t for t in range(48)] for i in range(3)]  # 3 blocks each
    for i, tokens in enumerate(prompts):
        d.add(f"r{i}", tokens, max_tokens=1)
        d.run()
    cpu = d.published.events(MEDIUM_CPU)
    stored = hashes([e for e in cpu if isinstance(e, BlockStored)])
    removed = hashes([e for e in cpu if isinstance(e, BlockRemoved)])
    gpu = hashes([e for e in d.published.events(MEDIUM_GPU) if isinstance(e, BlockStored)])
    first_prompt = gpu[:3]
    assert stored == gpu  # every block of the three prompts was stored once
    assert removed == first_prompt  # the third prompt's saves evicted the first's
    assert d.connector.index_stats()["evicted"] == 3
    # A removal always follows the store it undoes.
    order = [(type(e), h) for e in cpu for h in e.block_hashes]
    for h in removed:
        assert order.index((BlockStored, h)) < order.index((BlockRemoved, h))


def test_reset_cache_announces_every_dropped_block_removed(events_sim):
    d = events_sim(host_cache(), write_kv=False)
    d.add("A", PREFIX + [1], max_tokens=1)
    d.run()
    assert d.scheduler.reset_prefix_cache(reset_connector=True)
    d.step()  # the next step publishes what the reset caused
    cpu = d.published.events(MEDIUM_CPU)
    assert [type(e) for e in cpu] == [BlockStored, BlockRemoved]
    assert sorted(cpu[1].block_hashes) == sorted(cpu[0].block_hashes)
    assert d.connector.index_stats()["ready"] == 0


def test_a_block_loaded_back_is_not_announced_again(events_sim):
    d = events_sim(host_cache())
    d.add("A", PREFIX + [1], max_tokens=1)
    d.run()
    d.scheduler.reset_prefix_cache()  # vLLM forgets A; the tier keeps it
    d.add("B", PREFIX + [2], max_tokens=1)
    assert d.step().num_scheduled_tokens["B"] == 1  # 48 tokens loaded from the tier
    d.run()
    stored = [e for e in d.published.events(MEDIUM_CPU) if isinstance(e, BlockStored)]
    assert len(hashes(stored)) == 3


def test_without_kv_events_nothing_is_asked_of_the_tier(driver_factory):
    d = driver_factory(mux_config([host_child(), child("ExampleConnector")]))
    assert d.connector.active_children("take_events") == ()
    assert d.connector.take_events() == ()


# ------------------------------------------------------------- children


def worker_child(name: str, **extra: Any) -> dict[str, Any]:
    return {**child("WorkerEventsConnector", module=EVENTS, **extra), "name": name}


#: Two children reporting from their workers, with containers of different
#: classes: vLLM's LMCacheKVEvents (what every worker reported, once) and
#: one that keeps every worker's copy.
COMMON = {"medium": "STORAGE"}
KEEP_ALL = {"medium": "DISK", "keep_all": True}


def events_children() -> list[dict[str, Any]]:
    return [
        host_child(),
        child("SchedulerEventsConnector", module=EVENTS),
        worker_child("common", **COMMON),
        worker_child("keep-all", **KEEP_ALL),
    ]


def alone(events_sim: Any, **extra: Any) -> Any:
    """The worker-events child as vLLM's only connector, on two workers."""
    ktc = KVTransferConfig(
        kv_connector="WorkerEventsConnector",
        kv_connector_module_path=EVENTS,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    return events_sim(ktc, workers=2, write_kv=False)


def test_every_childs_events_are_published_labelled_with_the_child(events_sim):
    d = events_sim(mux_config(events_children()), workers=2, write_kv=False)
    d.add("A", PREFIX + [1, 2, 3], max_tokens=2)
    d.run()
    gpu = [e for e in d.published.events(MEDIUM_GPU) if isinstance(e, BlockStored)]
    by_child = {
        name: d.published.events(ownership=name)
        for name in ("KvmuxHostCache", "SchedulerEventsConnector", "common", "keep-all")
    }
    media = {name: {e.medium for e in events} for name, events in by_child.items()}
    assert media == {
        "KvmuxHostCache": {MEDIUM_CPU},
        "SchedulerEventsConnector": {"STORAGE"},
        "common": {"STORAGE"},
        "keep-all": {"DISK"},
    }
    for name, events in by_child.items():
        # Each tier's blocks are vLLM's blocks of the prompt, announced once.
        assert per_block(events) == per_block(gpu), name
    assert all(e.ownership is None for e in gpu)  # vLLM's own are not relabelled


def test_each_childs_worker_events_are_aggregated_as_the_child_does_alone(events_sim):
    """Both workers report the same stores. Each child gets its own
    container, merged over the workers as vLLM merges it alone: the
    LMCacheKVEvents child publishes each store once, as alone."""
    single = alone(events_sim, **COMMON)
    muxed = events_sim(mux_config(events_children()), workers=2, write_kv=False)
    for d in (single, muxed):
        d.add("A", PREFIX + [1, 2, 3], max_tokens=20)
        d.run()
    theirs = single.published.events("STORAGE")
    ours = muxed.published.events(ownership="common")
    assert theirs and [msgspec.structs.replace(e, ownership=None) for e in ours] == theirs


def test_repeats_of_one_event_are_published_once(events_sim):
    """The child whose container keeps every worker's copy: alone, vLLM
    publishes each store once per worker; under kvmux, once."""
    single = alone(events_sim, **KEEP_ALL)
    muxed = events_sim(mux_config(events_children()), workers=2, write_kv=False)
    for d in (single, muxed):
        d.add("A", PREFIX + [1], max_tokens=1)
        d.run()
    theirs = single.published.events("DISK")
    ours = muxed.published.events(ownership="keep-all")
    assert ours and len(theirs) == 2 * len(ours)
    assert hashes(ours) == hashes(theirs[::2]) == hashes(theirs[1::2])


def test_equal_events_of_two_children_are_both_published(events_sim):
    """Two tiers holding the same blocks are two residencies: a router must
    see each come and go, so neither is dropped."""
    two = [
        {**child("SchedulerEventsConnector", module=EVENTS, medium="CPU"), "name": name}
        for name in ("tier-a", "tier-b")
    ]
    d = events_sim(mux_config(two), write_kv=False)
    d.add("A", PREFIX + [1], max_tokens=1)
    d.run()
    a, b = d.published.events(ownership="tier-a"), d.published.events(ownership="tier-b")
    assert a and [msgspec.structs.replace(e, ownership="tier-b") for e in a] == b


def test_a_childs_own_ownership_is_kept_after_its_name():
    from kvmux.mux.events import child_label, labelled

    ev = BlockRemoved(block_hashes=[1], medium=MEDIUM_CPU, ownership="kvcr")
    assert [e.ownership for e in labelled([ev], "Offload")] == ["Offload/kvcr"]
    assert ev.ownership == "kvcr"  # the child's own event is not changed
    assert child_label("Offload", None) == "Offload"
    assert list(labelled([AllBlocksCleared()], "Offload")) == [AllBlocksCleared()]


def test_only_repeats_that_change_nothing_are_dropped():
    def stored(h: int, who: str = "t") -> BlockStored:
        return BlockStored(
            block_hashes=[h],
            parent_block_hash=None,
            token_ids=[h],
            block_size=1,
            lora_id=None,
            medium=MEDIUM_CPU,
            lora_name=None,
            ownership=who,
        )

    def removed(h: int, who: str = "t") -> BlockRemoved:
        return BlockRemoved(block_hashes=[h], medium=MEDIUM_CPU, ownership=who)

    # Two workers' copies of one step: once.
    assert deduplicated([stored(1), stored(2), stored(1), stored(2)]) == [stored(1), stored(2)]
    # A store, its removal and a store again all change something.
    again = [stored(1), removed(1), stored(1), removed(1)]
    assert deduplicated(again) == again
    # The same blocks in two tiers are two residencies.
    assert deduplicated([stored(1, "a"), stored(1, "b")]) == [stored(1, "a"), stored(1, "b")]
    # A clear forgets everything before it; repeated clears are one.
    clear = AllBlocksCleared()
    assert deduplicated([stored(1), clear, clear, stored(1)]) == [stored(1), clear, stored(1)]


def test_on_a_hybrid_model_each_group_announces_the_blocks_it_keeps(events_sim):
    """Gemma-like groups (sliding window, full attention): the full group's
    blocks and the window group's windows, each event with its group's
    index and kind, each block one vLLM announced in that group."""
    from tests.host_tier.test_host_cache_hma import (
        FULL_GROUP,
        PREFIX,
        SWA,
        WINDOW,
        HybridSim,
        host_cache,
    )

    d = HybridSim(host_cache())  # with vLLM's KV events on (events_sim)
    d.published = d.scheduler.kv_event_publisher = Published()
    d.add("A", PREFIX + [1, 2, 3], max_tokens=1)
    d.run()
    cpu = d.published.events(MEDIUM_CPU)
    gpu = [e for e in d.published.events(MEDIUM_GPU) if isinstance(e, BlockStored)]
    for g, kind, window in ((FULL_GROUP, "full_attention", None), (SWA, "sliding_window", WINDOW)):
        ours = [e for e in cpu if e.group_idx == g]
        assert ours and {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in ours} == {
            (kind, window)
        }
        assert set(per_block(ours)) <= set(per_block([e for e in gpu if e.group_idx == g]))
    full = len(per_block([e for e in cpu if e.group_idx == FULL_GROUP]))
    windowed = len(per_block([e for e in cpu if e.group_idx == SWA]))
    assert full == len(PREFIX) // BLOCK_SIZE and windowed < full
    host = d.host().group_stats()
    assert [full, windowed] == [host[FULL_GROUP]["stored"], host[SWA]["stored"]]
