"""The process ``benches/p1_callgrind.sh`` runs under callgrind: records P1's
scheduler calls (``python -m benches.overhead --only P1``'s 64 request
lifecycles) on one side, then waits for ``FLAG.go``, replays them ``N``
times, writes ``FLAG.done`` and waits for ``FLAG.end``. Only the replays are
instrumented (the script switches callgrind on and off around them), so the
instruction count is the connector's own, repeatable on a noisy machine.

    python -m benches.p1_callgrind_replay kvmux|mc N FLAG   # from the repository root
"""

from __future__ import annotations

import gc
import logging
import os
import random
import sys
import time

from benches.overhead import lifecycle
from tests.support.sim import BLOCK_SIZE


def _wait(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.2)


def main() -> None:
    side, n, flag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    logging.disable(logging.WARNING)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 1000) for _ in range(rng.randrange(2, 12) * BLOCK_SIZE + 5)]
        for _ in range(64)
    ]
    if side == "kvmux":
        ktc = lifecycle._ktc("KvmuxConnector", "kvmux")
    else:
        ktc = lifecycle._ktc("MultiConnector", None)
    sim, calls = lifecycle.record(ktc, prompts, 4)
    replay, _ = lifecycle.replayer(sim, calls)
    for _ in range(3):
        replay()
    gc.collect()
    gc.disable()
    open(flag + ".ready", "w").close()
    _wait(flag + ".go")
    for _ in range(n):
        replay()
    open(flag + ".done", "w").close()
    _wait(flag + ".end")


if __name__ == "__main__":
    main()
