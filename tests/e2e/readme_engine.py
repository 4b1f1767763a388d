"""Run one README configuration in a real engine, in a process of its own (as
``vllm serve`` has one engine per process), and print what it served as JSON.

    python -m tests.e2e.readme_engine MODEL_DIR CONFIG_JSON BLOCK_SIZE [--wipe-host-tier]

(from the repository root, which holds the ``tests`` package).

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

from kvmux.cli import engine

ASK = {"num_extra_cached_tokens": None, "host_cache_stats": None, "cached_token_stats": True}


def _host_tier_wiped(llm: Any) -> int:
    """Forget what kvmux's host tier holds (scheduler side, in-process engine
    core), so the next pass must come from the other child."""
    host = llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector().children[0]
    return host.scheduler.index.clear_unpinned()


def _llvmlite_safe_for_the_kernel_scan() -> None:
    """vLLM 0.32's CPU platform scans every module in ``sys.modules`` when
    its worker starts and reads ``vars()`` of each value with a ``__dict__``;
    llvmlite's ``ffi.lib`` fabricates one through ``__getattr__`` and the scan
    fails (``'_lib_fn_wrapper' object has no attribute 'get'``). LMCache
    imports llvmlite (through numba), and under the ``MultiConnector`` name
    with HMA-capable children vLLM imports every child class to decide the
    hybrid KV cache manager, before this in-process engine core starts its
    worker. ``vllm serve`` runs the engine core in a process of its own, where
    the README's LMCache block starts as written (measured); here the scan is
    given a real, empty ``__dict__`` entry for that object."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    ffi.lib._fntab.setdefault("__dict__", {})


def main(model_dir: str, config_json: str, block_size: int, wipe: bool) -> dict[str, Any]:
    from tests.e2e.engine_runs import WORKLOAD, reset_prefix_cache

    engine.prepare_env(multiprocess=False)
    _llvmlite_safe_for_the_kernel_scan()
    llm = engine.make_llm(model_dir, json.loads(config_json), block_size=block_size)
    out: dict[str, Any] = {
        "hma_on": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    }
    prompts = WORKLOAD.prompts()
    passes = [engine.run_pass(llm, prompts, WORKLOAD.max_tokens, ASK)]
    out["reset"] = reset_prefix_cache(llm)
    passes.append(engine.run_pass(llm, prompts, WORKLOAD.max_tokens, ASK))
    if wipe:
        out["wiped_blocks"] = _host_tier_wiped(llm)
        out["reset_again"] = reset_prefix_cache(llm)
        passes.append(engine.run_pass(llm, prompts, WORKLOAD.max_tokens, ASK))
    out["passes"] = [asdict(p) for p in passes]
    llm.llm_engine.engine_core.shutdown()
    return out


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--wipe-host-tier" in sys.argv[4:])
    print("RESULT " + json.dumps(result))
