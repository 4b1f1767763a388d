"""An event publisher for the KV-event tests: vLLM's publisher interface,
keeping each batch it is handed as a subscriber would decode it (msgpack,
``KVEventBatch``)."""

from __future__ import annotations

from typing import Any

import msgspec
from vllm.distributed.kv_events import EventPublisher, KVEventBatch

__all__ = ["Published"]


class Published(EventPublisher):
    """vLLM's publisher interface, keeping what it is handed as a subscriber
    would decode it."""

    def __init__(self) -> None:
        super().__init__(0)
        self.batches: list[KVEventBatch] = []
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode

    def publish(self, events: Any) -> None:
        self.batches.append(self._decode(msgspec.msgpack.encode(events)))

    def shutdown(self) -> None:
        pass

    def events(self, medium: str | None = None, ownership: Any = ...) -> list[Any]:
        """Every event published, of ``medium`` and ``ownership`` if given."""
        return [
            e
            for b in self.batches
            for e in b.events
            if (medium is None or getattr(e, "medium", None) == medium)
            and (ownership is ... or getattr(e, "ownership", None) == ownership)
        ]
