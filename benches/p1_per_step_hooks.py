"""P1's per-step hooks, each timed on its own with ``timeit`` (ns a call,
minimum of 5 x 20,000 calls), on a connector that replayed the recorded
scheduler calls of ``python -m benches.overhead --only P1``; and the whole replay
of 64 request lifecycles (us, minimum of 5 x 200). Run against two builds
in turn to compare them, from the repository root: python -m
benches.p1_per_step_hooks"""

from __future__ import annotations

import functools
import logging
import random
import timeit

from benches.overhead import lifecycle
from tests.support.sim import BLOCK_SIZE

HOOKS = (
    "build_connector_meta",
    "get_kv_connector_stats",
    "update_connector_output",
    "take_events",
    "has_pending_push_work",
    "on_new_request",
)


def main() -> None:
    logging.disable(logging.WARNING)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 1000) for _ in range(rng.randrange(2, 12) * BLOCK_SIZE + 5)]
        for _ in range(64)
    ]
    sim, calls = lifecycle.record(lifecycle._ktc("KvmuxConnector", "kvmux"), prompts, 4)
    replay, conn = lifecycle.replayer(sim, calls)
    replay()
    last = {name: (args, kwargs) for name, args, kwargs in calls}
    for name in HOOKS:
        if name not in last:
            continue
        args, kwargs = last[name]
        call = functools.partial(getattr(conn, name), *args, **kwargs)
        best = min(timeit.repeat(call, number=20_000, repeat=5))
        print(f"{name:28s} {best / 20_000 * 1e9:8.0f} ns")
    best = min(timeit.repeat(replay, number=200, repeat=5))
    print(f"{'replay of 64 lifecycles':28s} {best / 200 * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
