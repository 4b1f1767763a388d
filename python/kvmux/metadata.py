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
    saves: dict[str, tuple[int, int]] | None = None
    """Requests finished this step that children save asynchronously:
    request id -> (bit set of those children, how many of their completions
    the workers wait for: all of them, or 1 for a request kvmux never
    tracked). A completion from another child is dropped (``rust/completions.rs``)."""
    loads: dict[str, int] | None = None
    """Requests loading asynchronously from this step on: request id -> bit
    set of the children loading it asynchronously (one, or several spans
    under ``compose``); the request is finished receiving once each
    reported it, and no other child's receive completion reaches vLLM."""
    load_blocks: dict[str, list[int]] | None = None
    """Of those loaded by a child with a ``load_timeout_ms``: request id ->
    the device blocks the load writes (group 0), which a worker reports as
    load errors if the load misses its deadline (vLLM without failed
    receives)."""


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
