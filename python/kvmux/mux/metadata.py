"""What travels between kvmux's scheduler side and its workers (pickled)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvmux import _core

__all__ = ["KvmuxMetadata", "KvmuxWorkerMetadata"]


#: Scheduler -> workers, once per step: ``children`` (each child's own
#: metadata, in config order), ``saves``, ``loads`` and ``load_blocks`` (what
#: the workers must know of the requests since the last step; see the
#: class's docstring). Built by the Rust ``SchedulerMux.build_connector_meta``
#: as an object of the bindings' own (``rust/bindings/mux/metadata.rs``), so
#: vLLM's call returns with no Python frame of kvmux's; registered here as a
#: vLLM ``KVConnectorMetadata``.
KvmuxMetadata = _core.KvmuxMetadata
KVConnectorMetadata.register(KvmuxMetadata)


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
