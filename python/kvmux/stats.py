"""Connector stats through vLLM's ``get_kv_connector_stats`` path.

vLLM collects stats from every worker (and from the scheduler-side connector),
aggregates them, serialises them with ``to_dict()`` and rebuilds them in the
front end with the connector class's ``build_kv_connector_stats(data)``. The
serialised form of :class:`KvmuxStats` is plain data::

    {"kvmux": {counter: int, ...},
     "children": {child_name: {"cls": "module:Class", "data": {...}}}}

so it survives the process boundary and each child's own stats are rebuilt by
that child's class.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["KvmuxPromMetrics", "KvmuxStats", "build_child_stats"]


def _cls_path(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def _rebuild_child(entry: Any) -> KVConnectorStats | None:
    if isinstance(entry, KVConnectorStats):
        return entry
    if not isinstance(entry, Mapping) or "cls" not in entry:
        return None
    module, _, qual = str(entry["cls"]).partition(":")
    try:
        stats_cls: Any = importlib.import_module(module)
        for part in qual.split("."):
            stats_cls = getattr(stats_cls, part)
    except (ImportError, AttributeError):
        return None
    return stats_cls(data=dict(entry.get("data") or {}))


@dataclass
class KvmuxStats(KVConnectorStats):
    """kvmux's own counters plus each child's stats, kept per child name."""

    @property
    def counters(self) -> dict[str, int]:
        return self.data.setdefault("kvmux", {})

    @property
    def children(self) -> dict[str, KVConnectorStats]:
        return self.data.setdefault("children", {})

    @classmethod
    def rebuild(cls, data: Mapping[str, Any] | None) -> KvmuxStats:
        out = cls()
        if not data:
            return out
        out.data["kvmux"] = dict(data.get("kvmux") or {})
        for name, entry in (data.get("children") or {}).items():
            child = _rebuild_child(entry)
            if child is not None:
                out.children[name] = child
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "kvmux": dict(self.counters),
            "children": {
                name: {"cls": _cls_path(s), "data": s.to_dict()}
                for name, s in self.children.items()
            },
        }

    def aggregate(self, other: KVConnectorStats) -> KvmuxStats:
        if not isinstance(other, KvmuxStats):
            other = KvmuxStats.rebuild(other.data)
        mine = self.counters
        for k, v in other.counters.items():
            mine[k] = mine.get(k, 0) + v
        for name, s in other.children.items():
            have = self.children.get(name)
            self.children[name] = s if have is None else have.aggregate(s)
        return self

    def reset(self) -> None:
        self.data["kvmux"] = {}
        for s in self.children.values():
            s.reset()

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {f"kvmux.{k}": v for k, v in self.counters.items() if v}
        for name, s in self.children.items():
            if not s.is_empty():
                for k, v in s.reduce().items():
                    out[f"{name}.{k}"] = v
        return out

    def is_empty(self) -> bool:
        return not any(self.counters.values()) and all(s.is_empty() for s in self.children.values())


def build_child_stats(
    names: Sequence[str],
    child_stats: Sequence[KVConnectorStats | None],
    counters: Mapping[str, int] | None = None,
) -> KvmuxStats | None:
    """One :class:`KvmuxStats` from kvmux's counter deltas and the children's
    stats of the last interval; None when there is nothing to report."""
    out = KvmuxStats()
    if counters:
        out.data["kvmux"] = {k: v for k, v in counters.items() if v}
    for name, s in zip(names, child_stats, strict=True):
        if s is not None:
            out.children[name] = s
    return None if out.is_empty() else out


class KvmuxPromMetrics(KVConnectorPromMetrics):
    """Forwards each child's stats to that child's own Prometheus metrics."""

    def __init__(self, *args: Any, children: dict[str, KVConnectorPromMetrics]) -> None:
        super().__init__(*args)
        self._children = children

    @classmethod
    def build(
        cls,
        cfg: Any,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvmuxPromMetrics:
        children: dict[str, KVConnectorPromMetrics] = {}
        by_class: dict[type, KVConnectorPromMetrics | None] = {}
        for spec in cfg.children:
            # A class registers its metric names once; children of one class share them.
            if spec.cls not in by_class:
                by_class[spec.cls] = spec.cls.build_prom_metrics(
                    spec.vllm_config_for(vllm_config),
                    metric_types,
                    labelnames,
                    per_engine_labelvalues,
                )
            prom = by_class[spec.cls]
            if prom is not None:
                children[spec.name] = prom
        return cls(vllm_config, metric_types, labelnames, per_engine_labelvalues, children=children)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, entry in (transfer_stats_data.get("children") or {}).items():
            prom = self._children.get(name)
            if prom is not None and isinstance(entry, Mapping):
                prom.observe(entry.get("data") or {}, engine_idx)
