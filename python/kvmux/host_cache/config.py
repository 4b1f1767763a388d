"""``kv_connector_extra_config`` of ``KvmuxHostCache``: its capacity, and
whether it promotes blocks other children loaded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmux.errors import KvmuxConfigError

__all__ = ["HostCacheConfig", "parse_host_cache_config"]

GIB = 1 << 30
ALLOWED = ("capacity_gib", "num_blocks", "promote")
EXAMPLE = '{"capacity_gib": 8} or {"num_blocks": 4096}'


@dataclass(frozen=True)
class HostCacheConfig:
    capacity_gib: float | None
    num_blocks: int | None
    promote: bool = True
    """Save the blocks another child loaded (the next request for the prefix
    is then served from host memory); False: only the blocks the engine
    computes."""

    def num_slots(self, block_bytes: int) -> int:
        """Host slots for blocks of ``block_bytes`` bytes (one block of every
        layer of the largest KV cache group: a slot holds any group's block)."""
        if self.num_blocks is not None:
            return self.num_blocks
        slots = int(self.capacity_gib * GIB) // block_bytes  # type: ignore[operator]
        if slots < 1:
            raise KvmuxConfigError(
                f"KvmuxHostCache capacity_gib={self.capacity_gib} holds no KV block "
                f"(one block of a KV cache group's layers is {block_bytes} bytes); raise "
                "capacity_gib"
            )
        return slots


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
        isinstance(gib, bool) or not isinstance(gib, int | float) or not gib > 0
    ):
        problems.append(
            f"KvmuxHostCache: capacity_gib must be a positive number of GiB, got {gib!r}"
        )
    if blocks is not None and (
        isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1
    ):
        problems.append(f"KvmuxHostCache: num_blocks must be a positive integer, got {blocks!r}")
    promote = extra.get("promote", True)
    if not isinstance(promote, bool):
        problems.append(f"KvmuxHostCache: promote must be true or false, got {promote!r}")
    if problems:
        raise KvmuxConfigError(problems)
    return HostCacheConfig(
        capacity_gib=float(gib) if gib is not None else None,
        num_blocks=int(blocks) if blocks is not None else None,
        promote=promote,
    )
