"""What the host tier's scheduler side and workers tell each other."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["HostCacheMetadata", "HostCacheWorkerMetadata", "LoadJob", "SaveJob"]


@dataclass(frozen=True)
class LoadJob:
    req_id: str
    slots: tuple[int, ...]
    blocks: tuple[int, ...]
    group: int = 0
    """The KV cache group whose device ``blocks`` the slots fill."""
    failed: bool = False
    """vLLM allocated blocks for the tier to fill that it does not hold ready
    (the lookup did not offer them and they could not be pinned at
    allocation): ``slots`` is empty, ``blocks`` are every device block of
    the load, and the worker reports them as load errors so vLLM recomputes
    them."""


@dataclass(frozen=True)
class SaveJob:
    req_id: str
    blocks: tuple[int, ...]
    slots: tuple[int, ...]
    group: int = 0
    """The KV cache group whose device ``blocks`` are saved."""


@dataclass
class HostCacheMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    finished_async: list[str] = field(default_factory=list)
    """Finished requests whose ``request_finished`` returned True: report
    each in ``get_finished`` once its saves are done."""


@dataclass
class HostCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: slots whose copies completed (or failed), counted
    per worker so the scheduler acts only once every worker reported."""

    saved: Counter[int] = field(default_factory=Counter)
    failed_saves: Counter[int] = field(default_factory=Counter)
    loaded: Counter[int] = field(default_factory=Counter)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HostCacheWorkerMetadata:
        if not isinstance(other, HostCacheWorkerMetadata):
            raise TypeError(f"cannot aggregate host-tier metadata with {type(other).__name__}")
        return HostCacheWorkerMetadata(
            saved=self.saved + other.saved,
            failed_saves=self.failed_saves + other.failed_saves,
            loaded=self.loaded + other.loaded,
        )

    def is_empty(self) -> bool:
        return not (self.saved or self.failed_saves or self.loaded)
