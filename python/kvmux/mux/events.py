"""KV cache events of every child as one stream, in vLLM's KV event types.

vLLM collects a connector's KV cache events on two paths and publishes them
with its own GPU events (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` from ``vllm.distributed.kv_events``) through its KV
event publisher, so a KV-aware router sees which tier holds which block:

- scheduler side, ``take_events()``, every step;
- worker side, ``get_kv_connector_kv_cache_events()``: a container per
  worker (a ``KVConnectorKVEvents``) that vLLM merges across workers
  (``KVOutputAggregator``: ``add_events(other.get_all_events())`` and
  ``increment_workers(1)``) and hands to the scheduler-side connector in
  ``update_connector_output``, which publishes them from ``take_events``.

For several children, kvmux keeps each child's events the child's own:

- worker side, :class:`KvmuxKVEvents` holds each child's container, merged
  across workers child by child exactly as vLLM merges one connector's;
- scheduler side, each child's ``update_connector_output`` sees its own
  container (:func:`own_worker_events`), so the child aggregates and
  publishes them as it would alone;
- ``take_events``: each child's events are labelled with the child
  (:func:`labelled`: vLLM's ``ownership`` field, "secondary tier identifier")
  and identical events are dropped where that is safe
  (:func:`deduplicated`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import msgspec
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents

__all__ = [
    "KvmuxKVEvents",
    "child_label",
    "deduplicated",
    "labelled",
    "own_worker_events",
]

#: The field of vLLM's ``BlockStored`` / ``BlockRemoved`` that names the tier
#: an event comes from ("Secondary offloading tier identifier, if generated
#: by one"; vLLM's own tiers keep stores and removals apart by medium and
#: ownership).
LABEL_FIELD = "ownership"


def child_label(child: str, ownership: str | None) -> str:
    """The ``ownership`` of a child's event under kvmux: the child's name,
    followed by ``/`` and the child's own ``ownership`` when it set one (a
    child with tiers of its own, e.g. vLLM's ``OffloadingConnector``)."""
    return child if not ownership else f"{child}/{ownership}"


def labelled(events: Iterable[Any], child: str) -> Iterator[Any]:
    """``events`` with ``ownership`` naming ``child`` (copies: a child may
    still hold its events in a hashed container). Events without the field
    (``AllBlocksCleared``) pass unchanged."""
    for event in events:
        if LABEL_FIELD in getattr(event, "__struct_fields__", ()):
            own = getattr(event, LABEL_FIELD)
            yield msgspec.structs.replace(event, **{LABEL_FIELD: child_label(child, own)})
        else:
            yield event


def _blocks(event: Any) -> list[tuple[Any, ...]] | None:
    """The residencies an event speaks of: (block hash, medium, ownership,
    locality, group); None for an event about no particular block."""
    hashes = getattr(event, "block_hashes", None)
    if hashes is None:
        return None
    where = (
        getattr(event, "medium", None),
        getattr(event, LABEL_FIELD, None),
        getattr(event, "locality", None),
        getattr(event, "group_idx", None),
    )
    return [(h, *where) for h in hashes]


def deduplicated(events: Sequence[Any]) -> list[Any]:
    """``events`` (one step's, in order) without the repeats that say nothing
    new: an event equal to one kept earlier (same type, blocks, medium,
    label, every field) is dropped when no event since spoke of any of its
    blocks in the same tier; an event about no block (``AllBlocksCleared``)
    when it repeats the event just before it. A store, a removal and a store
    again of one block are all kept, and so are equal events from two
    children: each child's label makes them two residencies, which a router
    must see come and go separately."""
    out: list[Any] = []
    standing: set[Any] = set()  # kept events no later event contradicted
    about: dict[tuple[Any, ...], list[Any]] = {}  # residency -> events kept about it
    for event in events:
        blocks = _blocks(event)
        if blocks is None:
            if not (out and out[-1] == event):
                out.append(event)
            standing.clear()
            about.clear()
            continue
        try:
            if event in standing:
                continue
        except TypeError:  # an unhashable event type: never dropped
            out.append(event)
            for b in blocks:
                for old in about.pop(b, ()):
                    standing.discard(old)
            continue
        for b in blocks:
            for old in about.pop(b, ()):
                standing.discard(old)
        standing.add(event)
        for b in blocks:
            about.setdefault(b, []).append(event)
        out.append(event)
    return out


class _PerChild(list[Any]):
    """What :meth:`KvmuxKVEvents.get_all_events` answers: every child's
    events (a plain list to any reader) that also carries the per-child
    containers, so that :meth:`KvmuxKVEvents.add_events` merges child by
    child."""

    def __init__(self, items: Iterable[Any], per_child: Sequence[KVConnectorKVEvents | None]):
        super().__init__(items)
        self.per_child = per_child


class KvmuxKVEvents(KVConnectorKVEvents):
    """One worker's KV cache events: each child's own container (None for a
    child with none this step), in config order.

    vLLM merges the workers' containers into the first one's
    (``add_events(other.get_all_events())``, then ``increment_workers(1)``);
    here each child's container is merged as vLLM merges that child's alone:
    the first worker's that has one, then each later one's events added and
    its worker count raised by one."""

    def __init__(self, per_child: Sequence[KVConnectorKVEvents | None]) -> None:
        self.per_child: list[KVConnectorKVEvents | None] = list(per_child)
        self._workers = 1

    def child(self, i: int) -> KVConnectorKVEvents | None:
        """Child ``i``'s container (merged over the workers)."""
        return self.per_child[i] if i < len(self.per_child) else None

    def add_events(self, events: list[KVCacheEvent]) -> None:
        per_child = getattr(events, "per_child", None)
        if per_child is None:
            raise TypeError(
                "kvmux's KV events merge only with another worker's KvmuxKVEvents "
                "(events without their child cannot be given to it); every worker "
                "must run the same KvmuxConnector configuration"
            )
        for i, theirs in enumerate(per_child):
            if not theirs:  # vLLM skips a worker's empty container alike
                continue
            if i >= len(self.per_child):
                self.per_child.extend([None] * (i + 1 - len(self.per_child)))
            mine = self.per_child[i]
            if mine is None:
                self.per_child[i] = theirs
            else:
                mine.add_events(theirs.get_all_events())
                mine.increment_workers(1)

    def aggregate(self) -> KvmuxKVEvents:
        for c in self.per_child:
            if c is not None:
                c.aggregate()
        return self

    def increment_workers(self, count: int = 1) -> None:
        # Each child's count was raised as its events were added.
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        items = [e for c in self.per_child if c is not None for e in c.get_all_events()]
        return _PerChild(items, self.per_child)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        for c in self.per_child:
            if c is not None:
                c.clear_events()
        self._workers = 1

    def __repr__(self) -> str:
        return f"<KvmuxKVEvents per_child={self.per_child!r}>"


def own_worker_events(i: int, hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Child ``i``'s ``update_connector_output`` seeing, in the workers'
    output, its own KV events container instead of kvmux's (None when it
    sent none), as vLLM would hand it the child's alone; restored after."""

    def update_connector_output(connector_output: Any) -> Any:
        events = connector_output.kv_cache_events
        if not isinstance(events, KvmuxKVEvents):
            return hook(connector_output)
        connector_output.kv_cache_events = events.child(i)
        try:
            return hook(connector_output)
        finally:
            connector_output.kv_cache_events = events

    update_connector_output.__wrapped__ = hook  # type: ignore[attr-defined]
    return update_connector_output
