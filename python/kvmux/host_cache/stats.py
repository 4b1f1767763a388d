"""The host tier's stats: plain summed counters, serialisable as a dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["COUNTERS", "GROUP_COUNTERS", "HostCacheStats"]

COUNTERS = (
    "lookups",  # requests looked up
    "lookup_hit_tokens",  # tokens offered to vLLM beyond its local prefix cache
    "loaded_tokens",  # tokens vLLM allocated for the tier to load
    "stored_blocks",  # blocks whose save completed
    "evicted_blocks",  # blocks dropped by LRU to make room
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


@dataclass
class HostCacheStats(KVConnectorStats):
    def add(self, name: str, n: int) -> None:
        if n:
            self.data[name] = self.data.get(name, 0) + n

    def aggregate(self, other: KVConnectorStats) -> HostCacheStats:
        for k, v in other.data.items():
            self.add(k, v)
        return self

    def reset(self) -> None:
        self.data = {}

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        out.update(sorted((k, v) for k, v in self.data.items() if k.startswith("group")))
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
