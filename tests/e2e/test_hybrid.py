"""A hybrid model through ``KvmuxHostCache`` in a real engine, with vLLM's
defaults: the tiny Gemma 3 (``tests/e2e/tiny_gemma3.py``: sliding-window
layers of a 64-token window beside full attention) has two KV cache groups,
and vLLM keeps its hybrid KV cache manager on for the host tier, alone (the
README's "host-tier-alone" block) and under ``KvmuxConnector`` beside
another HMA child.

Each run serves the same prompts twice with ``reset_prefix_cache`` between:
the outputs are token-identical to an engine with no connector, and in the
second pass the first request of each shared prefix loads it from the host
tier in both groups (the full-attention group every block, the sliding
window group the window before the resume point), which the model's output
depends on: a token changed inside that window, or anywhere before it,
changes the greedy output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvmux.cli import engine
from tests.e2e.engine_runs import ASK, WORKLOAD, close_llm, reset_prefix_cache
from tests.support.readme_configs import readme_configs, substitute

BLOCK = engine.CPU_BLOCK_SIZE  # 32 tokens
PREFIX_BLOCKS = WORKLOAD.prefix_blocks  # 4: a 128-token shared prefix
WINDOW_BLOCKS = 2  # ceil((64 - 1) / 32): what a resume point reads of the window group
HMA_TAGGER = {
    "kv_connector": "HMATaggingConnector",
    "kv_connector_module_path": "tests.e2e.hma_tagging_connector",
    "kv_role": "kv_both",
}


@dataclass
class Run:
    hma_on: bool
    groups: list[str]
    passes: list[engine.PassResult]
    group_stats: list[dict[str, Any]]


def _run(model: str, config: dict[str, Any] | None) -> Run:
    llm = engine.make_llm(model, config)
    try:
        core = llm.llm_engine.engine_core.engine_core
        kv = core.scheduler.kv_cache_config
        hma_on = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        prompts = WORKLOAD.prompts()
        ask = ASK if config else None
        first = engine.run_pass(llm, prompts, WORKLOAD.max_tokens, ask)
        if not reset_prefix_cache(llm):
            raise RuntimeError("vLLM did not reset its prefix cache")
        second = engine.run_pass(llm, prompts, WORKLOAD.max_tokens, ask)
        stats: list[dict[str, Any]] = []
        if config:
            conn = core.scheduler.connector
            host = conn.children[0] if hasattr(conn, "children") else conn
            stats = host.group_stats()
        return Run(
            hma_on,
            [type(g.kv_cache_spec).__name__ for g in kv.kv_cache_groups],
            [first, second],
            stats,
        )
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def gemma() -> str:
    from tests.e2e.tiny_gemma3 import tiny_gemma3

    return str(tiny_gemma3())


@pytest.fixture(scope="module")
def runs(gemma: str) -> dict[str, Run]:
    engine.prepare_env(multiprocess=False)
    alone = substitute(readme_configs()["host-tier-alone"].config, capacity_gib=0.05)
    return {
        "none": _run(gemma, None),
        "host-tier-alone": _run(gemma, alone),
        "kvmux": _run(gemma, engine.host_tier_config(HMA_TAGGER)),
    }


WITH_TIER = ["host-tier-alone", "kvmux"]


def test_the_tiny_gemma3_has_a_sliding_window_and_a_full_attention_group(runs):
    assert runs["none"].hma_on
    assert runs["none"].groups == ["SlidingWindowSpec", "FullAttentionSpec"]


@pytest.mark.parametrize("name", WITH_TIER)
def test_vllm_keeps_the_hybrid_kv_cache_manager_on_with_the_host_tier(runs, name):
    assert runs[name].hma_on
    assert runs[name].groups == runs["none"].groups


@pytest.mark.parametrize("name", WITH_TIER)
def test_outputs_are_token_identical_to_no_connector(runs, name):
    for got, want in zip(runs[name].passes, runs["none"].passes, strict=True):
        assert got.token_ids == want.token_ids


@pytest.mark.parametrize("name", WITH_TIER)
def test_after_a_reset_the_tier_serves_each_prefix_in_every_group(runs, name):
    second = runs[name].passes[1]
    loaded = second.host_loaded_tokens
    # The first request of each prefix loads it; the others find it in
    # vLLM's refilled prefix cache.
    assert loaded[: WORKLOAD.num_prefixes] == [PREFIX_BLOCKS * BLOCK] * WORKLOAD.num_prefixes
    assert set(loaded[WORKLOAD.num_prefixes :]) == {0}
    for stats in second.param("host_cache_stats")[: WORKLOAD.num_prefixes]:
        assert stats["groups"] == [
            {"kind": "sliding_window", "loaded_blocks": WINDOW_BLOCKS, "saved_blocks": 0},
            {"kind": "full_attention", "loaded_blocks": PREFIX_BLOCKS, "saved_blocks": 0},
        ]
    assert second.num_cached_tokens == [PREFIX_BLOCKS * BLOCK] * WORKLOAD.num_prompts


@pytest.mark.parametrize("name", WITH_TIER)
def test_the_window_group_stores_only_the_window_before_the_resume_point(runs, name):
    """Pass 1: each prefix's first request saves its 4 full-attention blocks
    but only the 2 window blocks before block 4 (its prompt's resume point);
    blocks 0 and 1 of the window group are never read again."""
    first = runs[name].passes[0]
    for stats in first.param("host_cache_stats")[: WORKLOAD.num_prefixes]:
        assert stats["groups"] == [
            {"kind": "sliding_window", "loaded_blocks": 0, "saved_blocks": WINDOW_BLOCKS},
            {"kind": "full_attention", "loaded_blocks": 0, "saved_blocks": PREFIX_BLOCKS},
        ]
    swa, full = runs[name].group_stats
    assert (swa["kind"], full["kind"]) == ("sliding_window", "full_attention")
    assert swa["stored"] == WINDOW_BLOCKS * WORKLOAD.num_prefixes
    assert full["stored"] == PREFIX_BLOCKS * WORKLOAD.num_prefixes


def test_under_kvmux_every_child_gets_every_group_and_params_merge(runs):
    for params in runs["kvmux"].passes[1].kv_transfer_params:
        assert params is not None
        assert params["tagged_by"] == "HMATaggingConnector"
        assert params["kv_cache_groups"] == 2
        assert "host_cache_stats" in params and "num_extra_cached_tokens" in params
    extra = runs["kvmux"].passes[1].param("num_extra_cached_tokens")
    assert extra == runs["kvmux"].passes[1].host_loaded_tokens
