"""The host tier's eviction policy and tenant shares, per policy, through
vLLM's real v1 scheduler (``tests.support.sim``: the real scheduler, the
tier's scheduler and worker sides, CPU tensors as the paged KV cache; the
model is the one stand-in, so there is no TTFT: the figure is the tier's hit
tokens, which does not depend on the machine's load).

Workloads (a 64-block tier, 16-token blocks; vLLM's own prefix cache is
emptied before each measured request, so the tier is what serves it):

- ``scan``: two hot prefixes of 8 blocks used three times, one pass of ten
  one-off prompts of 8 blocks (80 blocks, more than the tier), then the hot
  prefixes again. Measured: the tokens of the last pass served (of 256).
- ``scan hot 24, x2``: three hot prefixes (24 blocks, above the protected
  target's start of 16), two passes of the scan each followed by the hot
  prefixes (measured: both passes, of 2 x 384).
- ``tenants``: tenant B's prefix (8 blocks, ``cache_salt`` "B") once, tenant
  A floods 1.5x the tier (12 one-off prompts of 8 blocks, salt "A"), then
  B's prefix again. Measured: B's tokens served (of 128), at
  ``tenant_max_share`` 1.0 and 0.5.
- ``returning``: 16 users, each visits once with a 6-block context and
  returns ``gap`` users later (the return adds a block); measured: the
  tokens of the returns served (of 16 x 96). ``gap`` 4: every live context
  fits in the tier (LRU serves them all: no policy may lose there); ``gap``
  10: they do not quite (LRU loses some).

Each configuration runs ``--repeats`` times, the policies alternated; hit
tokens are deterministic, the wall time per request (the scheduler's and the
tier's CPU, noisy on a shared machine) is the median. Run it from the
repository root: ``python -m benches.host_policy [--repeats 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from tests.support.sim import BLOCK_SIZE, KVTransferConfig, SchedulerSim

TIER_BLOCKS = 64
PREFIX_BLOCKS = 8


def tier(**extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KvmuxHostCache",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={"num_blocks": TIER_BLOCKS, **extra},
    )


class Run:
    """One workload's run: its requests, the measured ones' hit tokens."""

    def __init__(self, **extra: Any) -> None:
        self.d = SchedulerSim(tier(**extra))
        self.requests = 0
        self.hit = 0
        self.measured = 0

    def request(
        self, name: str, tokens: list[int], salt: str | None = None, measure: bool = False
    ) -> int:
        d = self.d
        d.scheduler.reset_prefix_cache()
        d.add(name, tokens, kv_transfer_params={"host_cache_stats": True}, cache_salt=salt)
        d.run()
        self.requests += 1
        got = int(d.finished[name]["host_cache_stats"]["loaded_tokens"])
        if measure:
            self.hit += got
        return got

    def close(self) -> dict[str, Any]:
        gauges: dict[str, Any] = {}
        for snap in self.d.kv_stats:
            gauges.update({k: v for k, v in snap.items() if k.startswith("tier.")})
        self.d.close()
        return gauges


def blocks(start: int, n: int, extra: int = 1) -> list[int]:
    return list(range(start, start + n * BLOCK_SIZE + extra))


def scans(prefixes: int, passes: int) -> Callable[[Run], int]:
    def work(run: Run) -> int:
        hot = [blocks(1000 + i * 200, PREFIX_BLOCKS, 0) for i in range(prefixes)]
        for use in range(3):
            for i, h in enumerate(hot):
                run.request(f"hot{i}-{use}", [*h, 7, use])
        for p in range(passes):
            for j in range(10):
                run.request(f"scan{p}-{j}", blocks(5000 + (p * 10 + j) * 200, PREFIX_BLOCKS))
            for i, h in enumerate(hot):
                run.request(f"hot{i}-after{p}", [*h, 9, p], measure=True)
        return passes * sum(len(h) for h in hot)

    return work


def tenants(run: Run) -> int:
    b = blocks(1000, PREFIX_BLOCKS, 0)
    run.request("b0", [*b, 1], salt="B")
    for j in range(12):
        run.request(f"a{j}", blocks(5000 + j * 200, PREFIX_BLOCKS), salt="A")
    run.request("b1", [*b, 2], salt="B", measure=True)
    return len(b)


def returning(gap: int) -> Callable[[Run], int]:
    users, ctx = 16, 6

    def work(run: Run) -> int:
        context = [blocks(20_000 + u * 500, ctx, 0) for u in range(users)]
        for t in range(users + gap):
            if t < users:
                run.request(f"u{t}-visit", [*context[t], 1])
            if t >= gap:
                u = t - gap
                run.request(f"u{u}-return", [*context[u], *range(2, 2 + 20)], measure=True)
        return users * ctx * BLOCK_SIZE

    return work


#: name -> (workload, the configurations compared: label -> extra config).
WORKLOADS: dict[str, tuple[Callable[[Run], int], dict[str, dict[str, Any]]]] = {
    "scan": (scans(2, 1), {"lru": {"eviction": "lru"}, "slru (default)": {}}),
    # A hot set above the target (24 blocks; the target starts at 16): the
    # first pass loses part of it, whose return grows the target.
    "scan hot 24, x2": (scans(3, 2), {"lru": {"eviction": "lru"}, "slru (default)": {}}),
    "tenants": (
        tenants,
        {
            "lru, share 1.0": {"eviction": "lru"},
            "slru, share 1.0 (default)": {},
            "lru, share 0.5": {"eviction": "lru", "tenant_max_share": 0.5},
            "slru, share 0.5": {"tenant_max_share": 0.5},
        },
    ),
    "returning gap 4": (returning(4), {"lru": {"eviction": "lru"}, "slru (default)": {}}),
    "returning gap 10": (returning(10), {"lru": {"eviction": "lru"}, "slru (default)": {}}),
}


def measure(repeats: int, only: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (work, configs) in WORKLOADS.items():
        if only and name not in only:
            continue
        rows: dict[str, Any] = {label: {"hit": [], "ms_per_request": []} for label in configs}
        for r in range(repeats):
            labels = list(configs)
            if r % 2:
                labels.reverse()  # alternate the order against drift
            for label in labels:
                run = Run(**configs[label])
                t0 = time.perf_counter()
                total = work(run)
                elapsed = time.perf_counter() - t0
                gauges = run.close()
                row = rows[label]
                row["hit"].append(run.hit)
                row["ms_per_request"].append(1000 * elapsed / run.requests)
                row["of"] = total
                row["gauges"] = gauges
        out[name] = rows
    return out


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{'workload':18} {'policy':28} {'hit tokens':>16} {'ms/req p50':>11}  tier gauges"]
    for name, rows in report.items():
        for label, row in rows.items():
            hits = sorted(set(row["hit"]))
            hit = "/".join(map(str, hits))
            g = row["gauges"]
            gauges = ", ".join(
                f"{k[len('tier.') :]} {g.get(k, 0)}"
                for k in (
                    "tier.protected_slots",
                    "tier.protected_target_slots",
                    "tier.tenants",
                    "tier.evicted_share_blocks",
                    "tier.evicted_protected_blocks",
                )
            )
            ms = statistics.median(row["ms_per_request"])
            lines.append(
                f"{name:18} {label:28} {hit + ' / ' + str(row['of']):>16} {ms:11.1f}  {gauges}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benches.host_policy", description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", nargs="*", choices=list(WORKLOADS), help="workloads to run")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    report = measure(args.repeats, args.only)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
