"""P3: the host tier's longest-prefix lookup for a 32k-token prompt (2,048
blocks of 16 tokens, all cached).

- kvmux: ``KvmuxHostCache.get_num_new_matched_tokens`` (scheduler side, built
  by vLLM's connector factory): the request's block hashes into the Rust
  block index in one call.
- rival: ``SimpleCPUOffloadConnector.get_num_new_matched_tokens`` (vLLM's
  scheduler side, built by the same factory): its
  ``SimpleCPUOffloadScheduler`` looks the hashes up in its CPU ``BlockPool``
  through ``find_longest_cache_hit`` and pins the hit blocks (the pin of the
  previous call is dropped first, so repeats are alike).

Both tiers hold the same 2,048 blocks, keyed by the same vLLM block hashes of
the same real ``Request``: kvmux's index through the core's ``reserve`` and
``commit`` (what a confirmed save does), vLLM's pool through
``BlockPool.cache_full_blocks`` then ``free_blocks`` (what its store
completion does).
"""

from __future__ import annotations

import random
from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvmux.bench.case import Case
from kvmux.bench.sim import BLOCK_SIZE, kv_cache_config, make_request, vllm_config

__all__ = ["build"]

PROMPT_BLOCKS = 2048
POOL_BLOCKS = 4096


def _conn(name: str, module: str | None, extra: dict[str, Any]) -> Any:
    ktc = KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    cfg = vllm_config(ktc)
    return KVConnectorFactory.create_connector(
        config=cfg, role=KVConnectorRole.SCHEDULER, kv_cache_config=kv_cache_config()
    )


def build(quick: bool) -> Case:
    rng = random.Random(0)
    # One token past 2,048 full blocks: vLLM computes the last token itself.
    tokens = [rng.randrange(1, 1000) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE + 1)]
    request = make_request("long-prompt", tokens)
    hashes = list(request.block_hashes)
    if len(hashes) != PROMPT_BLOCKS:
        raise RuntimeError(f"expected {PROMPT_BLOCKS} block hashes, got {len(hashes)}")

    host = _conn("KvmuxHostCache", "kvmux", {"num_blocks": POOL_BLOCKS})
    index = host.scheduler.index
    index.commit(index.reserve(hashes).slots)

    simple = _conn("SimpleCPUOffloadConnector", None, {"num_cpu_blocks": POOL_BLOCKS})
    mgr = simple.scheduler_manager
    pool = mgr.cpu_block_pool
    blocks = pool.get_new_blocks(PROMPT_BLOCKS)
    pool.cache_full_blocks(request, blocks, 0, PROMPT_BLOCKS, BLOCK_SIZE, 0)
    pool.free_blocks(blocks)

    def kvmux() -> Any:
        return host.get_num_new_matched_tokens(request, 0)

    def rival() -> Any:
        return simple.get_num_new_matched_tokens(request, 0)

    want = PROMPT_BLOCKS * BLOCK_SIZE

    def check() -> None:
        got = {"kvmux": kvmux()[0], "SimpleCPUOffloadConnector": rival()[0]}
        if set(got.values()) != {want}:
            raise RuntimeError(f"the lookups do not both find {want} tokens: {got}")

    return Case(
        key="P3",
        title="host-tier prefix lookup, 32k-token prompt (2,048 blocks)",
        kvmux=kvmux,
        rival=rival,
        rival_name="vLLM SimpleCPUOffloadConnector",
        unit="lookup of 2,048 blocks",
        target=0.1,
        inner=20 if quick else 100,
        check=check,
        notes={
            "blocks": PROMPT_BLOCKS,
            "rival_path": "SimpleCPUOffloadConnector.get_num_new_matched_tokens -> "
            "SimpleCPUOffloadScheduler -> KVCacheCoordinator.find_longest_cache_hit",
        },
    )
