"""The model-free demo: vLLM's real v1 scheduler with kvmux over two children
(its own host tier and vLLM's ExampleConnector) on a synthetic workload of
requests that share long prefixes, in one process with no GPU and no model
(the model runner is stood in: ``tests.support.harness.SchedulerSim``). Pass 1 fills
the tiers; vLLM's own prefix cache is then wiped; pass 2 loads the shared
prefixes back from the host tier, and the demo checks the loaded KV is
bit-identical. Needs vLLM 0.33 (``scripts/env.sh vllm-0.33``); from the
repository root:

    python -m tests.support.demo_scheduler [--requests N ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import tempfile
import time
from typing import Any

__all__ = ["add_arguments", "main", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefixes", type=int, default=3, help="distinct shared prefixes")
    p.add_argument("--requests", type=int, default=12, help="requests per pass")
    p.add_argument("--prefix-blocks", type=int, default=6, help="blocks in each shared prefix")
    p.add_argument("--host-blocks", type=int, default=256, help="capacity of the host tier")
    p.add_argument("--seed", type=int, default=0)


def _children(storage: str, host_blocks: int) -> list[dict[str, Any]]:
    return [
        {
            "kv_connector": "KvmuxHostCache",
            "kv_connector_module_path": "kvmux",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_blocks": host_blocks},
        },
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        },
    ]


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    import torch
    from vllm.config import KVTransferConfig

    from tests.support.harness import BLOCK_SIZE, SchedulerSim

    rng = random.Random(args.seed)
    storage = tempfile.mkdtemp(prefix="kvmux-demo-")
    ktc = KVTransferConfig(
        kv_connector="KvmuxConnector",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": _children(storage, args.host_blocks)},
    )
    sim = SchedulerSim(ktc, num_blocks=512)
    prefixes = [
        [rng.randrange(1, 1000) for _ in range(args.prefix_blocks * BLOCK_SIZE)]
        for _ in range(args.prefixes)
    ]
    ask = {"num_extra_cached_tokens": None, "host_cache_stats": None}

    def one_pass(tag: str) -> tuple[float, list[str]]:
        ids = []
        t0 = time.perf_counter()
        for i in range(args.requests):
            prompt = prefixes[i % args.prefixes] + [rng.randrange(1, 1000) for _ in range(13)]
            rid = f"{tag}-{i}"
            sim.add(rid, prompt, max_tokens=4, kv_transfer_params=dict(ask))
            ids.append(rid)
        sim.run(max_steps=10_000)
        return time.perf_counter() - t0, ids

    print("kvmux demo: vLLM's real v1 scheduler, kvmux over", sim.connector.child_names)
    t1, _ = one_pass("pass1")
    sim.scheduler.reset_prefix_cache()  # vLLM forgets; the host tier does not
    # Pass 2's loads are checked against the KV the prefixes must have.
    loaded_ok = []
    real_step = sim.step

    def checked_step() -> Any:
        so = real_step()
        for req in so.scheduled_new_reqs:
            n = req.num_computed_tokens
            if n:
                toks = sim.scheduler.requests[req.req_id].all_token_ids[:n]
                loaded_ok.append(
                    all(
                        torch.equal(
                            sim.device_kv(req.req_id, layer, n), sim.expected_kv(toks, layer)
                        )
                        for layer in range(len(sim.kv_caches))
                    )
                )
        return so

    sim.step = checked_step  # type: ignore[method-assign]
    t2, ids2 = one_pass("pass2")

    stats = sim.connector.mux_stats()
    print(
        f"\n{'child':<22}{'lookups':>9}{'hits':>6}{'hit tok':>9}{'loads':>7}"
        f"{'load tok':>10}{'async saves':>13}"
    )
    for name, c in stats["children"].items():
        print(
            f"{name:<22}{c['lookups']:>9}{c['hits']:>6}{c['hit_tokens']:>9}{c['loads']:>7}"
            f"{c['load_tokens']:>10}{c['async_saves']:>13}"
        )
    extra = [sim.finished[r]["num_extra_cached_tokens"] for r in ids2]
    print("\nmerged kv_transfer_params of the first pass-2 request:")
    print("  ", sim.finished[ids2[0]])
    print(f"num_extra_cached_tokens in pass 2: {extra} (sum {sum(extra)})")
    print(f"async-save completions reported finished sending: {len(sim.finished_sending)}")
    print(f"pass-2 loads bit-identical to the saved KV: {sum(loaded_ok)}/{len(loaded_ok)}")
    print(f"time: pass 1 {t1 * 1e3:.1f} ms, pass 2 {t2 * 1e3:.1f} ms")
    print(f"live requests left in kvmux: {sim.connector.num_live_requests()}")
    ok = bool(loaded_ok) and all(loaded_ok) and sum(extra) > 0
    ok = ok and sim.connector.num_live_requests() == 0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.demo_scheduler", description=__doc__
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
