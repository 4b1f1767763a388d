"""kvmux inside a real vLLM engine generating tokens on the CPU: what a user
relies on when they put ``KvmuxConnector`` into ``vllm serve`` / ``LLM``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmux.cli.engine import CPU_BLOCK_SIZE as BLOCK_SIZE
from tests.e2e.engine_runs import WORKLOAD, Runs

ROOT = Path(__file__).resolve().parents[2]


def full_prompt_blocks_tokens(prompt: list[int]) -> int:
    """Tokens in the prompt's full blocks that vLLM may take from a cache (it
    always computes the last prompt token itself)."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_greedy_outputs_with_kvmux_are_token_identical_to_no_connector(runs: Runs):
    assert runs.mux1.token_ids == runs.base1.token_ids
    assert runs.mux2.token_ids == runs.base2.token_ids == runs.base1.token_ids
    assert all(len(t) == WORKLOAD.max_tokens for t in runs.mux2.token_ids)


def test_after_reset_the_second_pass_loads_shared_prefixes_from_the_host_tier(runs: Runs):
    # Pass 1 starts cold: nothing comes from the host tier.
    assert runs.mux1.host_loaded_tokens == [0] * len(runs.prompts)
    # Pass 2, after vLLM wiped its own prefix cache: every request has all its
    # cacheable prompt blocks cached again, and each shared prefix came from
    # the host tier at least once (the first request of each had no other source).
    expected = [full_prompt_blocks_tokens(p) for p in runs.prompts]
    assert runs.mux2.num_cached_tokens == expected
    host = runs.mux2.host_loaded_tokens
    assert sum(host) >= WORKLOAD.num_prefixes * WORKLOAD.prefix_tokens
    assert all(n % BLOCK_SIZE == 0 for n in host)
    # What the host tier loaded is what kvmux reports per request.
    assert host == runs.mux2.param("num_extra_cached_tokens")
    # Without kvmux, the same second pass recomputes those prefixes.
    assert sum(runs.base2.num_cached_tokens) == sum(runs.mux2.num_cached_tokens) - sum(host)


def test_params_of_both_children_are_merged_into_the_request_output(runs: Runs):
    for prompt, params in zip(runs.prompts, runs.mux2.kv_transfer_params, strict=True):
        assert params is not None
        assert params["tagged_by"] == "TaggingConnector"  # the second child
        assert params["prompt_tokens"] == len(prompt)
        assert set(params["host_cache_stats"]) == {"loaded_tokens", "saved_blocks"}  # host tier
        assert params["num_extra_cached_tokens"] >= 0  # kvmux's own


def test_num_extra_cached_tokens_only_for_requests_that_ask_for_it(runs: Runs):
    assert all("num_extra_cached_tokens" in p for p in runs.mux2.kv_transfer_params)
    for params in runs.mux_not_asked.kv_transfer_params:
        assert "num_extra_cached_tokens" not in params
        assert "host_cache_stats" not in params
        assert params["tagged_by"] == "TaggingConnector"
    assert runs.mux_not_asked.token_ids == runs.base1.token_ids


@pytest.mark.multiprocess
def test_demo_with_the_default_multi_process_engine_serves_from_the_host_tier():
    """vLLM's default: the engine core (scheduler-side connector) and the
    worker in their own processes, started with spawn; run as a user would,
    through ``python -m kvmux demo``."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run(
        [sys.executable, "-m", "kvmux", "demo", "--multiprocess", "--prompts", "4"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "engine core in its own process" in out
    assert "hybrid KV cache manager: on" in out  # vLLM's default, no flag
    assert "outputs identical, pass 1 (computed) vs pass 2 (host tier): 4/4" in out
    host_pass2 = int(out.split("\npass 2")[1].split()[-1])
    assert host_pass2 >= 2 * 128
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("OK: outputs identical, the host tier served; "), last
