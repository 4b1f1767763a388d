"""What travels between kvmux's scheduler side and its workers (pickled)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["KvmuxMetadata", "KvmuxWorkerMetadata"]


@dataclass
class KvmuxMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    children: tuple[KVConnectorMetadata, ...]
    """Each child's own metadata, in config order."""
    extra_async_saves: dict[str, int] | None = None
    """Finished requests saved asynchronously by k > 1 children: request id ->
    k - 1, the completions a worker swallows before reporting the request."""
    dropped_saves: dict[str, tuple[int, ...]] | None = None
    """Finished requests for which a child's failure was contained (it never
    took part in them; see ``kvmux._containment``): request id -> those
    children, whose completions of the request a worker drops."""


@dataclass
class KvmuxWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: each child's own, in config order."""

    children: tuple[KVConnectorWorkerMetadata | None, ...]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvmuxWorkerMetadata:
        if not isinstance(other, KvmuxWorkerMetadata) or len(other.children) != len(self.children):
            raise TypeError(
                f"cannot aggregate kvmux worker metadata with {type(other).__name__}: "
                "every worker must run the same kvmux configuration"
            )
        return KvmuxWorkerMetadata(
            children=tuple(
                b if a is None else a if b is None else a.aggregate(b)
                for a, b in zip(self.children, other.children, strict=True)
            )
        )
