"""P1 split by hook: replays the recorded scheduler calls of
``python -m benches.overhead --only P1`` on kvmux and on vLLM's MultiConnector,
timing each call on its own (so every figure carries ~0.25 us of timer per
call). Run from the repository root: python -m benches.p1_per_hook"""

from __future__ import annotations

import collections
import random
import time

from benches.overhead import lifecycle
from tests.support.sim import BLOCK_SIZE


def main() -> None:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 1000) for _ in range(rng.randrange(2, 12) * BLOCK_SIZE + 5)]
        for _ in range(64)
    ]
    res: dict[str, dict[str, float]] = {}
    for side, ktc in (
        ("kvmux", lifecycle._ktc("KvmuxConnector", "kvmux")),
        ("MultiConnector", lifecycle._ktc("MultiConnector", None)),
    ):
        sim, calls = lifecycle.record(ktc, prompts, 4)
        _, conn = lifecycle.replayer(sim, calls)
        seq = [(getattr(conn, n), n, a, k) for n, a, k in calls]
        t: collections.Counter[str] = collections.Counter()
        for rep in range(30):
            for fn, n, a, k in seq:
                t0 = time.perf_counter_ns()
                fn(*a, **k)
                if rep >= 5:
                    t[n] += time.perf_counter_ns() - t0
        res[side] = {n: v / 25 / 1000 for n, v in t.items()}
    print(f"{'hook':32s} {'kvmux us':>10s} {'MultiConnector us':>18s}")
    for n in res["kvmux"]:
        print(f"{n:32s} {res['kvmux'][n]:10.1f} {res['MultiConnector'][n]:18.1f}")


if __name__ == "__main__":
    main()
