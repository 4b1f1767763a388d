"""The host tier's stats: plain summed counters, serialisable as a dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = [
    "COUNTERS",
    "GROUP_COUNTERS",
    "POLICY_GAUGES",
    "TIER",
    "TIER_GAUGES",
    "HostCacheStats",
]

COUNTERS = (
    "lookups",  # requests looked up
    "lookup_hit_tokens",  # tokens offered to vLLM beyond its local prefix cache
    "loaded_tokens",  # tokens vLLM allocated for the tier to load
    "stored_blocks",  # blocks whose save completed
    "evicted_blocks",  # blocks evicted to make room (any cause; see tier.evicted_*)
    "bytes_saved",  # device -> host bytes
    "bytes_loaded",  # host -> device bytes
    "load_errors",  # blocks that could not be loaded (vLLM recomputes them)
    "promoted_blocks",  # blocks another child loaded, saved here (promote)
)

#: Per KV cache group ``g``, as ``group<g>.<counter>``, for any layout but
#: the plain one (several groups, or one sliding-window group).
GROUP_COUNTERS = (
    "stored_blocks",  # the group's blocks whose save completed
    "loaded_blocks",  # the group's blocks loaded (a window group: its window only)
    "skipped_blocks",  # a window group's full blocks not stored: no resume point reads them
)


#: The tier's size and usage now, as ``tier.<gauge>`` (and, per KV cache
#: group ``g``, ``tier.group<g>.used_slots``): gauges, so a later report
#: replaces an earlier one instead of adding up. Reported by the scheduler
#: side whenever they change.
TIER = "tier."
TIER_GAUGES = (
    "capacity_slots",  # host slots (one KV block each)
    "capacity_bytes",  # host memory of those slots
    "used_slots",  # slots holding a block (ready, or a save in flight)
    "used_bytes",
    "pinned_slots",  # slots an in-flight load or save holds (never evicted)
)

#: The eviction policy's and the tenant shares' state, as ``tier.<gauge>``
#: beside :data:`TIER_GAUGES` (counts only: no name of a tenant). The two
#: ``evicted_*`` are lifetime counts of the tier (a later report replaces an
#: earlier one, so they are gauges here and in Prometheus).
POLICY_GAUGES = (
    "tenants",  # tenants (cache_salt values; no salt is one) holding a block
    "protected_slots",  # blocks read back, kept over blocks written once (slru)
    "protected_target_slots",  # the protected blocks' adapted target (slru; 0 under lru)
    "evicted_share_blocks",  # blocks evicted by the tenant share rule, lifetime
    "evicted_protected_blocks",  # blocks evicted although read back, lifetime
)


@dataclass
class HostCacheStats(KVConnectorStats):
    def add(self, name: str, n: int) -> None:
        if n:
            self.data[name] = self.data.get(name, 0) + n

    def set_tier(
        self, capacity: int, used: int, pinned: int, group_used: list[int], slot_bytes: int
    ) -> None:
        """The tier's gauges now (see :data:`TIER_GAUGES`)."""
        now = (capacity, capacity * slot_bytes, used, used * slot_bytes, pinned)
        self.data.update({TIER + k: v for k, v in zip(TIER_GAUGES, now, strict=True)})
        self.data.update({f"{TIER}group{g}.used_slots": n for g, n in enumerate(group_used)})

    def set_policy(
        self,
        tenants: int,
        protected: int,
        protected_target: int,
        evicted_share: int,
        evicted_protected: int,
    ) -> None:
        """The policy's gauges now (see :data:`POLICY_GAUGES`)."""
        now = (tenants, protected, protected_target, evicted_share, evicted_protected)
        self.data.update({TIER + k: v for k, v in zip(POLICY_GAUGES, now, strict=True)})

    def aggregate(self, other: KVConnectorStats) -> HostCacheStats:
        for k, v in other.data.items():
            if k.startswith(TIER):
                self.data[k] = v  # a gauge: the later report wins
            else:
                self.add(k, v)
        return self

    def reset(self) -> None:
        self.data = {}

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        out.update(sorted((k, v) for k, v in self.data.items() if k.startswith(("group", TIER))))
        if out["lookups"]:
            out["hit_tokens_per_lookup"] = round(out["lookup_hit_tokens"] / out["lookups"], 1)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> HostCacheStats | None:
        """This interval's stats (None if empty); the counters restart."""
        if self.is_empty():
            return None
        out = HostCacheStats(data=dict(self.data))
        self.reset()
        return out

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> HostCacheStats:
        return cls(data=dict(data or {}))
