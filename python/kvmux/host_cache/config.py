"""``kv_connector_extra_config`` of ``KvmuxHostCache``: its capacity,
whether it promotes blocks other children loaded, its eviction policy and
the most one tenant (``cache_salt``) may hold."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmux.errors import KvmuxConfigError

__all__ = ["HostCacheConfig", "parse_host_cache_config"]

GIB = 1 << 30
#: The most slots the host index holds (its slots are u32, one kept as "none").
MAX_SLOTS = (1 << 32) - 2
ALLOWED = ("capacity_gib", "num_blocks", "promote", "eviction", "tenant_max_share")
#: The values of ``eviction``, the default first: ``slru`` keeps the blocks
#: read back over the blocks written once (scan-resistant), ``lru`` evicts
#: the least recently used (recency only). The rule is the Rust index's
#: (``rust/host_tier/block_index.rs``).
EVICTIONS = ("slru", "lru")
EXAMPLE = '{"capacity_gib": 8} or {"num_blocks": 4096}'


@dataclass(frozen=True)
class HostCacheConfig:
    capacity_gib: float | None
    num_blocks: int | None
    promote: bool = True
    """Save the blocks another child loaded (the next request for the prefix
    is then served from host memory); False: only the blocks the engine
    computes."""
    eviction: str = EVICTIONS[0]
    """The eviction policy (:data:`EVICTIONS`)."""
    tenant_max_share: float = 1.0
    """The most one tenant (a request's ``cache_salt``; requests without one
    are one tenant) holds of the tier while others want room, in (0, 1];
    1.0: no limit."""

    def num_slots(self, block_bytes: int) -> int:
        """Host slots for blocks of ``block_bytes`` bytes (one block of every
        layer of the largest KV cache group: a slot holds any group's block).
        A tier this machine's memory cannot hold is refused here, on either
        role, before anything is allocated."""
        if self.num_blocks is not None:
            slots, key = self.num_blocks, f"num_blocks={self.num_blocks}"
        else:
            slots = int(self.capacity_gib * GIB) // block_bytes  # type: ignore[operator]
            key = f"capacity_gib={self.capacity_gib:g}"
            if slots < 1:
                raise KvmuxConfigError(
                    f"KvmuxHostCache {key} holds no KV block (one block of a KV cache "
                    f"group's layers is {block_bytes} bytes); raise capacity_gib"
                )
        memory = machine_memory()
        if slots * block_bytes > memory:
            raise KvmuxConfigError(
                f"KvmuxHostCache {key} needs {slots * block_bytes / GIB:.3g} GiB of host "
                f"memory ({slots} blocks of {block_bytes} bytes), more than this machine's "
                f"{memory / GIB:.3g} GiB; lower it (e.g. capacity_gib of at most half the "
                "machine's memory)"
            )
        if slots > MAX_SLOTS:
            raise KvmuxConfigError(
                f"KvmuxHostCache {key} is {slots} blocks, more than the host index's "
                f"{MAX_SLOTS}; lower it"
            )
        return slots


def machine_memory() -> int:
    """This machine's physical memory in bytes (a very large number where the
    platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def parse_host_cache_config(extra: Any) -> HostCacheConfig:
    """Validate; raise :class:`KvmuxConfigError` listing every problem."""
    if not isinstance(extra, Mapping):
        raise KvmuxConfigError(
            f"KvmuxHostCache kv_connector_extra_config is a {type(extra).__name__}; "
            f"give a dict such as {EXAMPLE}"
        )
    problems = [
        f"KvmuxHostCache: unknown key {k!r} in kv_connector_extra_config; allowed: {list(ALLOWED)}"
        for k in extra
        if k not in ALLOWED
    ]
    gib, blocks = extra.get("capacity_gib"), extra.get("num_blocks")
    if gib is None and blocks is None:
        problems.append(f"KvmuxHostCache needs a capacity: set {EXAMPLE}")
    elif gib is not None and blocks is not None:
        problems.append("KvmuxHostCache: set capacity_gib or num_blocks, not both")
    if gib is not None and (
        isinstance(gib, bool)
        or not isinstance(gib, int | float)
        or not math.isfinite(gib)
        or not gib > 0
    ):
        problems.append(
            f"KvmuxHostCache: capacity_gib must be a positive, finite number of GiB "
            f"(e.g. 8), got {gib!r}"
        )
    elif gib is not None and gib * GIB > machine_memory():
        problems.append(
            f"KvmuxHostCache: capacity_gib={gib!r} is more than this machine's memory "
            f"({machine_memory() / GIB:.3g} GiB); lower it"
        )
    if blocks is not None and (
        isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1
    ):
        problems.append(f"KvmuxHostCache: num_blocks must be a positive integer, got {blocks!r}")
    elif blocks is not None and blocks > MAX_SLOTS:
        problems.append(
            f"KvmuxHostCache: num_blocks={blocks} is more than the host index holds "
            f"({MAX_SLOTS} blocks); lower it"
        )
    promote = extra.get("promote", True)
    if not isinstance(promote, bool):
        problems.append(f"KvmuxHostCache: promote must be true or false, got {promote!r}")
    eviction = extra.get("eviction", EVICTIONS[0])
    if not isinstance(eviction, str) or eviction not in EVICTIONS:
        problems.append(
            f"KvmuxHostCache: eviction={eviction!r} is not a policy; set eviction to "
            f'"slru" (the default: keeps blocks read back over blocks written once) or '
            f'"lru" (least recently used first), or leave it out'
        )
    share = extra.get("tenant_max_share", 1.0)
    if (
        isinstance(share, bool)
        or not isinstance(share, int | float)
        or not math.isfinite(share)
        or not 0 < share <= 1
    ):
        problems.append(
            f"KvmuxHostCache: tenant_max_share={share!r} is not a fraction in (0, 1]; set "
            "the most one cache_salt may hold of the tier while others want room, e.g. 0.5, "
            "or leave it out (1.0: no limit)"
        )
    if problems:
        raise KvmuxConfigError(problems)
    return HostCacheConfig(
        capacity_gib=float(gib) if gib is not None else None,
        num_blocks=int(blocks) if blocks is not None else None,
        promote=promote,
        eviction=eviction,
        tenant_max_share=float(share),
    )
