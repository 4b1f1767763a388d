"""kvmux's overhead against what users would pick instead
(``python -m benches.overhead``, from the repository root).

Each comparison (P1..P4, P1h: P1 with the host tier as its one child,
S1: requests' time to schedule while one child stalls, C1: the time to
load prefixes split between two tiers with ``load_policy`` compose against
first and longest, and C1L: C1 with the real LMCache server as the second
tier, listed only where LMCache is installed) puts kvmux and its
rival side by side in one process, on the same children and inputs, built
through vLLM's real classes (the scheduler simulator and the no-op children
of ``tests/support``), and reports the ratio of their times: on a noisy
machine absolute times mean little, ratios measured in one run mean a lot.
See ``benches/RESULTS.md``.
"""

from __future__ import annotations

from kvmux.bench.lmcache import unavailable as _lmcache_unavailable

__all__ = ["CASES", "UNAVAILABLE"]

#: key -> module with ``build(quick) -> Case``
CASES = {
    "P1": "benches.overhead.lifecycle",
    "P2": "benches.overhead.layers",
    "P3": "benches.overhead.lookup",
    "P4": "benches.overhead.copies",
    "P1h": "benches.overhead.host_lifecycle",
    "S1": "benches.overhead.stall",
    "C1": "benches.overhead.compose",
}

#: key -> why the case is not in :data:`CASES` on this machine
UNAVAILABLE: dict[str, str] = {}

if (_why := _lmcache_unavailable()) is None:
    CASES["C1L"] = "benches.overhead.compose_lmcache"  # starts a real LMCache server
else:
    UNAVAILABLE["C1L"] = _why
