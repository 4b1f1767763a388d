"""The floor of P1h under a design where kvmux calls its host tier's Rust
side directly (no host-tier Python under the multiplexer).

Runs the workload of ``python -m benches.overhead --only P1h``, alternating
four sides: kvmux, vLLM's MultiConnector, the host tier alone, and the host
tier alone with its Rust index timed (``HostIndex`` behind a timing proxy).
Each side takes the median of RUNS runs. It prints:

- the time spent in the hooks for each side;
- the time spent inside the index;
- the host tier's Python time: alone minus index;
- P1h, the kvmux time over the MultiConnector time, measured here;
- the floor: kvmux without the host tier's Python, over MultiConnector.

The floor is optimistic. A Rust host tier still reads the request's block
hashes and keeps its stats. Run it from the repository root:
``python -m benches.p1h_floor``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from vllm.config import KVTransferConfig

from benches.overhead import host_lifecycle as hl
from kvmux.host_cache import scheduler as host_scheduler

RUNS = 7


class _TimedIndex:
    """``HostIndex`` with the time inside each of its calls added up."""

    def __init__(self, inner: Any, spent: list[float]) -> None:
        self._inner, self._spent = inner, spent

    def __getattr__(self, name: str) -> Any:
        f = getattr(self._inner, name)
        if not callable(f):
            return f

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self._spent[0] += time.perf_counter() - t0

        return timed


def main() -> None:
    prompts = hl.workload(1024)
    alone = KVTransferConfig(**hl.HOST)
    sides = {
        "kvmux": hl.Lifecycles(hl._ktc("KvmuxConnector", "kvmux"), prompts),
        "MultiConnector": hl.Lifecycles(hl._ktc("MultiConnector", None), prompts),
        "host tier alone": hl.Lifecycles(alone, prompts),
        "host tier alone, index timed": hl.Lifecycles(alone, prompts),
    }
    spent = [0.0]
    plain_init = host_scheduler.HostCacheScheduler.__init__

    def timed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        plain_init(self, *args, **kwargs)
        self.index = _TimedIndex(self.index, spent)

    times: dict[str, list[float]] = {k: [] for k in sides}
    in_index: list[float] = []
    for _ in range(RUNS):
        for name, side in sides.items():
            if name.endswith("index timed"):
                host_scheduler.HostCacheScheduler.__init__ = timed_init  # type: ignore[method-assign]
                spent[0] = 0.0
                try:
                    times[name].append(side())
                finally:
                    host_scheduler.HostCacheScheduler.__init__ = plain_init  # type: ignore[method-assign]
                in_index.append(spent[0])
            else:
                times[name].append(side())
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    index_ms = statistics.median(in_index) * 1e3
    python_ms = med["host tier alone"] - index_ms
    for name, ms in med.items():
        print(f"{name:30s} {ms:8.2f} ms")
    print(f"{'inside the Rust index':30s} {index_ms:8.2f} ms")
    print(f"{'host tier Python (alone - index)':30s} {python_ms:8.2f} ms")
    print(f"P1h here (kvmux / MultiConnector): {med['kvmux'] / med['MultiConnector']:.3f}")
    print(
        "floor without the host tier's Python under kvmux: "
        f"{(med['kvmux'] - python_ms) / med['MultiConnector']:.3f}"
    )


if __name__ == "__main__":
    main()
