"""P3: the host tier's longest-prefix lookup for a 32k-token prompt (2,048
blocks of 16 tokens, all cached; ``--block-size 64``, vLLM 0.34's GPU
default: the same 32,768 tokens in 512 blocks of 64).

- kvmux: ``KvmuxHostCache.get_num_new_matched_tokens`` (scheduler side, built
  by vLLM's connector factory): the request's block hashes into the Rust
  block index in one call.
- rival: ``SimpleCPUOffloadConnector.get_num_new_matched_tokens`` (vLLM's
  scheduler side, built by the same factory): its
  ``SimpleCPUOffloadScheduler`` looks the hashes up in its CPU ``BlockPool``
  through ``find_longest_cache_hit`` and pins the hit blocks (the pin of the
  previous call is dropped first, so repeats are alike).

Both tiers hold the same blocks (2,048 at 16 tokens), keyed by the same vLLM
block hashes of the same real ``Request``, hashed at the engine's block
size: kvmux's index through the core's ``reserve`` and ``commit`` (what a
confirmed save does), vLLM's pool through ``BlockPool.cache_full_blocks``
then ``free_blocks`` (what its store completion does).
"""

from __future__ import annotations

import random
from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from benches.overhead.case import Case
from tests.support.sim import BLOCK_SIZE, kv_cache_config, make_request, vllm_config

__all__ = ["build"]

#: The prompt's tokens (2,048 blocks of 16), whatever the block size.
PROMPT_TOKENS = 32_768
#: Host pool slots per prompt block: room for the prompt twice over.
POOL_PER_PROMPT = 2


def _conn(name: str, module: str | None, extra: dict[str, Any], block_size: int) -> Any:
    ktc = KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    cfg = vllm_config(ktc, block_size=block_size)
    return KVConnectorFactory.create_connector(
        config=cfg,
        role=KVConnectorRole.SCHEDULER,
        kv_cache_config=kv_cache_config(block_size=block_size),
    )


def build(quick: bool, block_size: int = BLOCK_SIZE) -> Case:
    """``block_size``: the engine's tokens per block; both tiers key the same
    32,768-token prompt at it (its full blocks: 512 at 64)."""
    if block_size <= 0:
        raise ValueError(f"P3: block size {block_size} is not positive")
    prompt_blocks = PROMPT_TOKENS // block_size
    pool_blocks = POOL_PER_PROMPT * prompt_blocks
    rng = random.Random(0)
    # One token past the full blocks: vLLM computes the last token itself.
    tokens = [rng.randrange(1, 1000) for _ in range(PROMPT_TOKENS + 1)]
    request = make_request("long-prompt", tokens, block_size=block_size)
    hashes = list(request.block_hashes)
    if len(hashes) != prompt_blocks:
        raise RuntimeError(f"expected {prompt_blocks} block hashes, got {len(hashes)}")

    host = _conn("KvmuxHostCache", "kvmux", {"num_blocks": pool_blocks}, block_size)
    if host.scheduler.block_size != block_size:
        raise RuntimeError(
            f"the host tier keys {host.scheduler.block_size}-token blocks, not {block_size}"
        )
    index = host.scheduler.index
    index.commit(index.reserve(hashes).slots)

    simple = _conn("SimpleCPUOffloadConnector", None, {"num_cpu_blocks": pool_blocks}, block_size)
    mgr = simple.scheduler_manager
    pool = mgr.cpu_block_pool
    blocks = pool.get_new_blocks(prompt_blocks)
    pool.cache_full_blocks(request, blocks, 0, prompt_blocks, block_size, 0)
    pool.free_blocks(blocks)

    def kvmux() -> Any:
        return host.get_num_new_matched_tokens(request, 0)

    def rival() -> Any:
        return simple.get_num_new_matched_tokens(request, 0)

    want = prompt_blocks * block_size

    def check() -> None:
        got = {"kvmux": kvmux()[0], "SimpleCPUOffloadConnector": rival()[0]}
        if set(got.values()) != {want}:
            raise RuntimeError(f"the lookups do not both find {want} tokens: {got}")

    return Case(
        key="P3",
        title="host-tier prefix lookup, 32k-token prompt "
        f"({prompt_blocks:,} blocks of {block_size})",
        kvmux=kvmux,
        rival=rival,
        rival_name="vLLM SimpleCPUOffloadConnector",
        unit=f"lookup of {prompt_blocks:,} blocks of {block_size} tokens",
        target=0.1,
        inner=20 if quick else 100,
        check=check,
        notes={
            "blocks": prompt_blocks,
            "block_size": block_size,
            "prompt_tokens": PROMPT_TOKENS,
            "rival_path": "SimpleCPUOffloadConnector.get_num_new_matched_tokens -> "
            "SimpleCPUOffloadScheduler -> KVCacheCoordinator.find_longest_cache_hit",
        },
    )
