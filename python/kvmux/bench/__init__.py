"""kvmux's benchmarks against what users would pick instead
(``python -m kvmux bench``).

Each comparison (P1..P4, P1h: P1 with the host tier as its one child,
S1: requests' time to schedule while one child stalls, C1: the time to
load prefixes split between two tiers with ``load_policy`` compose against
first and longest, and C1L: C1 with the real LMCache server as the second
tier, listed only where LMCache is installed) puts kvmux and its
rival side by side in one process, on the same children and inputs, built
through vLLM's real classes, and reports the ratio of their times: on a
noisy machine absolute times mean little, ratios measured in one run mean a
lot. See ``benches/RESULTS.md``.
"""

from __future__ import annotations

from kvmux.bench.lmcache import unavailable as _lmcache_unavailable

__all__ = ["CASES", "UNAVAILABLE"]

#: key -> module with ``build(quick) -> Case``
CASES = {
    "P1": "kvmux.bench.lifecycle",
    "P2": "kvmux.bench.layers",
    "P3": "kvmux.bench.lookup",
    "P4": "kvmux.bench.copies",
    "P1h": "kvmux.bench.host_lifecycle",
    "S1": "kvmux.bench.stall",
    "C1": "kvmux.bench.compose",
}

#: key -> why the case is not in :data:`CASES` on this machine
UNAVAILABLE: dict[str, str] = {}

if (_why := _lmcache_unavailable()) is None:
    CASES["C1L"] = "kvmux.bench.compose_lmcache"  # starts a real LMCache server
else:
    UNAVAILABLE["C1L"] = _why
