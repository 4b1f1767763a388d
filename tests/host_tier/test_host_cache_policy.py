"""``KvmuxHostCache``'s eviction policy and tenant shares through vLLM's real
scheduler (``tests.support.harness``): the issue's two cases, a hot set
through a scan larger than the tier and one tenant flooding another's share,
and the refusals of bad ``eviction`` / ``tenant_max_share`` values."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvmux import KvmuxConfigError, KvmuxHostCache
from tests.mux.test_hit_sources import HOST, Metrics
from tests.support.harness import BLOCK_SIZE, KVTransferConfig, SchedulerSim, mux_config

TIER_BLOCKS = 64
PREFIX_BLOCKS = 8
#: Two hot prefixes of 8 blocks (128 tokens each).
HOT = [
    list(range(1000 + i * PREFIX_BLOCKS * BLOCK_SIZE, 1000 + (i + 1) * PREFIX_BLOCKS * BLOCK_SIZE))
    for i in range(2)
]
HOT_TOKENS = sum(len(h) for h in HOT)  # 256


def host_cache(**extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KvmuxHostCache",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={"num_blocks": TIER_BLOCKS, **extra},
    )


def one_off(j: int) -> list[int]:
    """A prompt of 8 full blocks (and one token) seen once: a batch job's,
    a crawler's."""
    start = 5000 + j * (PREFIX_BLOCKS * BLOCK_SIZE + 1)
    return list(range(start, start + PREFIX_BLOCKS * BLOCK_SIZE + 1))


def served(d: Any, name: str, tokens: list[int], salt: str | None = None) -> int:
    """Run one request with vLLM's own prefix cache emptied first: the tokens
    the host tier loaded for it."""
    d.scheduler.reset_prefix_cache()
    d.add(name, tokens, kv_transfer_params={"host_cache_stats": True}, cache_salt=salt)
    d.run()
    return int(d.finished[name]["host_cache_stats"]["loaded_tokens"])


def tier_gauges(d: Any) -> dict[str, Any]:
    """The tier's latest ``tier.*`` gauges from vLLM's stats path."""
    out: dict[str, Any] = {}
    for snap in d.kv_stats:
        out.update({k: v for k, v in snap.items() if k.startswith("tier.")})
    return out


def hot_set_after_a_scan(driver_factory: Any, **extra: Any) -> tuple[int, Any]:
    """The issue's case: two hot prefixes used three times, one pass of ten
    one-off prompts (80 blocks, more than the 64-block tier), then the hot
    prefixes again: the tokens the tier serves them."""
    d = driver_factory(host_cache(**extra))
    for use in range(3):
        for i, hot in enumerate(HOT):
            got = served(d, f"hot{i}-{use}", [*hot, 7, use])
            assert got == (0 if use == 0 else len(hot)), "a hot prefix is served while it fits"
    for j in range(10):
        d.add(f"scan{j}", one_off(j))
        d.run()
    after = sum(served(d, f"hot{i}-after", [*hot, 9]) for i, hot in enumerate(HOT))
    return after, d


def test_the_default_policy_keeps_a_hot_set_through_a_scan_larger_than_the_tier(
    driver_factory,
):
    got, d = hot_set_after_a_scan(driver_factory)
    assert got >= HOT_TOKENS // 2, f"default policy served {got} of {HOT_TOKENS}"
    assert got == HOT_TOKENS  # measured: the whole hot set
    g = tier_gauges(d)
    assert g["tier.protected_slots"] >= 2 * PREFIX_BLOCKS
    assert g["tier.protected_target_slots"] == TIER_BLOCKS // 4  # no ghost came back
    assert g["tier.evicted_protected_blocks"] == 0
    assert g["tier.tenants"] == 1  # no salt: one tenant


def test_lru_loses_the_hot_set_to_the_scan(driver_factory):
    got, d = hot_set_after_a_scan(driver_factory, eviction="lru")
    assert got == 0  # the "now": recency only
    assert tier_gauges(d)["tier.protected_slots"] == 0


def returning_users(driver_factory: Any, **extra: Any) -> int:
    """16 users visit once (6-block contexts) and each returns 4 users later
    (its return adds a block): the tokens of the returns served."""
    d = driver_factory(host_cache(**extra))
    ctx = [list(range(20_000 + u * 500, 20_000 + u * 500 + 6 * BLOCK_SIZE)) for u in range(16)]
    got = 0
    for t in range(16 + 4):
        if t < 16:
            served(d, f"u{t}-visit", [*ctx[t], 1])
        if t >= 4:
            got += served(d, f"u{t - 4}-return", [*ctx[t - 4], *range(2, 22)])
    return got


def test_returning_users_are_served_as_under_lru(driver_factory):
    """A first-time block is admitted (no frequency filter), and the blocks
    read back once and never again do not crowd out the contexts users are
    about to return to: where LRU is right, the default serves as much."""
    lru = returning_users(driver_factory, eviction="lru")
    assert lru == 16 * 6 * BLOCK_SIZE  # every live context fits: LRU serves all
    assert returning_users(driver_factory) == lru


def flood(driver_factory: Any, **extra: Any) -> tuple[int, Any]:
    """Tenant B's prefix (8 blocks) once, then tenant A floods 1.5x the tier
    (12 one-off prompts of 8 blocks): the tokens B's prefix is served."""
    d = driver_factory(host_cache(**extra))
    assert served(d, "b-first", [*HOT[0], 1], salt="B") == 0
    for j in range(12):
        d.add(f"a{j}", one_off(j), cache_salt="A")
        d.run()
    return served(d, "b-again", [*HOT[0], 2], salt="B"), d


@pytest.mark.parametrize("eviction", ["slru", "lru"])
def test_a_tenant_over_its_share_evicts_its_own_blocks_not_anothers(driver_factory, eviction):
    got, d = flood(driver_factory, eviction=eviction, tenant_max_share=0.5)
    assert got >= len(HOT[0]) // 2, f"tenant B served {got} of {len(HOT[0])}"
    assert got == len(HOT[0])  # measured: all of it
    g = tier_gauges(d)
    assert g["tier.tenants"] == 2
    # A took the 56 free slots, then evicted its own 40 blocks.
    assert g["tier.evicted_share_blocks"] == 12 * PREFIX_BLOCKS - (TIER_BLOCKS - PREFIX_BLOCKS)


def test_without_a_share_one_tenants_flood_evicts_anothers_prefix(driver_factory):
    got, d = flood(driver_factory)  # tenant_max_share 1.0: one shared pool
    assert got == 0
    assert tier_gauges(d)["tier.evicted_share_blocks"] == 0


def test_the_policy_gauges_reach_prometheus_under_kvmux():
    """Under ``KvmuxConnector`` the counts (no label per tenant) are
    ``kvmux_tier_*`` gauges beside the tier's size."""
    child = {
        "kv_connector": HOST,
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_blocks": TIER_BLOCKS, "tenant_max_share": 0.5},
    }
    d = SchedulerSim(mux_config([child]))
    try:
        m = Metrics(d)
        for name, tokens in [("b0", [*HOT[0], 1]), ("b1", [*HOT[0], 2])]:
            served(d, name, tokens, "salt-B")
        for j in range(12):
            d.add(f"a{j}", one_off(j), cache_salt="salt-A")
            d.run()
        d.step()  # an idle step: the latest gauges are reported
        s = m.sample
        assert s("kvmux_tier_tenants", connector=HOST) == 2
        assert s("kvmux_tier_evicted_share_blocks", connector=HOST) == 40
        assert s("kvmux_tier_protected_slots", connector=HOST) == PREFIX_BLOCKS  # B's, read back
        assert s("kvmux_tier_protected_target_slots", connector=HOST) == TIER_BLOCKS // 4
        assert s("kvmux_tier_evicted_protected_blocks", connector=HOST) == 0
        values = {
            v
            for metric in REGISTRY.collect()
            for smp in metric.samples
            for v in smp.labels.values()
        }
        assert not values & {"salt-A", "salt-B"}, "no label per tenant"
    finally:
        d.close()


def test_salts_keep_isolating_tenants(driver_factory):
    d = driver_factory(host_cache(tenant_max_share=0.5))
    assert served(d, "b-first", [*HOT[0], 1], salt="B") == 0
    assert served(d, "a-same-tokens", [*HOT[0], 2], salt="A") == 0
    assert served(d, "unsalted", [*HOT[0], 3]) == 0
    assert served(d, "b-again", [*HOT[0], 4], salt="B") == len(HOT[0])


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"eviction": "arc"}, ["eviction='arc'", '"slru"', '"lru"']),
        ({"eviction": "LRU"}, ["eviction='LRU'", '"lru"']),
        ({"eviction": None}, ["eviction=None", '"slru"']),
        ({"tenant_max_share": 0}, ["tenant_max_share=0", "(0, 1]", "e.g. 0.5"]),
        ({"tenant_max_share": 1.5}, ["tenant_max_share=1.5", "(0, 1]"]),
        ({"tenant_max_share": -0.1}, ["tenant_max_share=-0.1"]),
        ({"tenant_max_share": "0.5"}, ["tenant_max_share='0.5'", "(0, 1]"]),
        ({"tenant_max_share": True}, ["tenant_max_share=True"]),
        ({"tenant_max_share": float("nan")}, ["tenant_max_share=nan"]),
    ],
)
def test_bad_eviction_or_share_is_refused_with_the_fix(h, extra, words):
    cfg = h.vllm_config(host_cache(**extra))
    with pytest.raises(KvmuxConfigError) as err:
        KvmuxHostCache(cfg, KVConnectorRole.SCHEDULER, h.kv_cache_config())
    for w in words:
        assert w in str(err.value)
    with pytest.raises(KvmuxConfigError):
        KvmuxHostCache.validate_transfer_config(host_cache(**extra))


@pytest.mark.parametrize(
    ("extra", "policy"),
    [
        ({}, ("slru", 1.0)),
        ({"eviction": "lru"}, ("lru", 1.0)),
        ({"eviction": "slru", "tenant_max_share": 0.25}, ("slru", 0.25)),
        ({"tenant_max_share": 1}, ("slru", 1.0)),
    ],
)
def test_the_settings_reach_the_index(h, extra, policy):
    conn = KvmuxHostCache(
        h.vllm_config(host_cache(**extra)), KVConnectorRole.SCHEDULER, h.kv_cache_config()
    )
    assert conn._sched.index.policy == policy
