"""Run one README configuration in a real engine, in a process of its own (as
``vllm serve`` has one engine per process), and print what it served as JSON.

    python readme_engine.py MODEL_DIR CONFIG_JSON BLOCK_SIZE [--wipe-host-tier]

Pass 1 computes; after ``reset_prefix_cache`` pass 2 may load from the host
tier; with ``--wipe-host-tier`` the host tier is emptied too and pass 3 may
load from the other tier (LMCache). A process of its own also keeps vLLM
0.32's CPU platform from tripping on modules an earlier engine loaded (its
kernel-override scan of ``sys.modules`` fails on llvmlite, which LMCache
imports, when a second engine starts in the same process).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

from kvmux import engine

ASK = {"num_extra_cached_tokens": None, "host_cache_stats": None, "cached_token_stats": True}


def _host_tier_wiped(llm: Any) -> int:
    """Forget what kvmux's host tier holds (scheduler side, in-process engine
    core), so the next pass must come from the other child."""
    host = llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector().children[0]
    return host.scheduler.index.clear_unpinned()


def main(model_dir: str, config_json: str, block_size: int, wipe: bool) -> dict[str, Any]:
    from engine_runs import WORKLOAD

    engine.prepare_env(multiprocess=False)
    llm = engine.make_llm(model_dir, json.loads(config_json), block_size=block_size)
    out: dict[str, Any] = {
        "hma_on": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    }
    prompts = WORKLOAD.prompts()
    passes = [engine.run_pass(llm, prompts, WORKLOAD.max_tokens, ASK)]
    out["reset"] = engine.reset_prefix_cache(llm)
    passes.append(engine.run_pass(llm, prompts, WORKLOAD.max_tokens, ASK))
    if wipe:
        out["wiped_blocks"] = _host_tier_wiped(llm)
        out["reset_again"] = engine.reset_prefix_cache(llm)
        passes.append(engine.run_pass(llm, prompts, WORKLOAD.max_tokens, ASK))
    out["passes"] = [asdict(p) for p in passes]
    llm.llm_engine.engine_core.shutdown()
    return out


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--wipe-host-tier" in sys.argv[4:])
    print("RESULT " + json.dumps(result))
