"""kvmux's stats and Prometheus metrics, through vLLM's own paths.

vLLM collects connector stats from every worker and from the scheduler-side
connector (``get_kv_connector_stats``), aggregates them, serialises them with
``to_dict()``, and in the front end rebuilds them with the connector class's
``build_kv_connector_stats(data)`` for the periodic log line, and hands the
dict to the ``build_prom_metrics`` object for Prometheus. The serialised form
of :class:`KvmuxStats` is plain data::

    {"kvmux": {"finished": 3, "clashes": {"first": 1}, ...,
               "children": {"KvmuxHostCache": {"lookups": 9, ...}, ...}},
     "children": {"KvmuxHostCache": {"cls": "module:Class", "data": {...}}}}

``"kvmux"`` holds kvmux's own counters for the interval (nested dicts of
ints, summed on aggregation), named by the Rust core: ``CHILD_COUNTERS``
under ``"children"``, ``TOTAL_COUNTERS`` beside, the two clash counters
folded into ``"clashes"`` (:data:`INTERVAL_TOTALS`); ``"children"`` each
child's own stats, rebuilt by that child's stats class, so they survive the
process boundary. The ``kvmux_*`` Prometheus counters (:data:`METRICS`) are
derived from the same names.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvmux._core import CHILD_COUNTERS, TOTAL_COUNTERS

__all__ = [
    "BREAKER_GAUGE",
    "BREAKER_STATE",
    "CHILD_METRICS",
    "CLASHES",
    "FOLDED_INTO_CLASHES",
    "GAUGES",
    "INTERVAL_TOTALS",
    "LOAD_DECISION",
    "LOAD_DECISION_CHILD_GAUGES",
    "LOAD_DECISION_COMPUTE_GAUGE",
    "METRICS",
    "TIER_GROUP_GAUGE",
    "TIER_METRICS",
    "TOTAL_METRICS",
    "KvmuxPromMetrics",
    "KvmuxStats",
    "build_child_stats",
    "nested_add",
    "nested_replace",
]

logger = logging.getLogger("kvmux")

Nested = dict[str, Any]


#: The key of the breakers' states in the scheduler's interval counters
#: (child name -> 0 closed, 1 half open, 2 open): a gauge, so the latest
#: report wins instead of adding up.
BREAKER_STATE = "breaker_state"
#: Its Prometheus gauge (label ``connector``).
BREAKER_GAUGE = (
    "kvmux_breaker_state",
    "A child's circuit breaker: 0 closed, 1 half open (one request probes it), 2 open.",
)


#: The key of what the load decision has learned in the scheduler's
#: interval counters and in ``mux_stats()``: ``{"compute_s_per_token": x,
#: "children": {name: {"load_s": a, "load_s_per_token": b,
#: "not_ready_wait_s": w}}}`` (each once measured). Gauges: the latest
#: report wins.
LOAD_DECISION = "load_decision"
#: Its Prometheus gauges, by key: the engine's (no label), then each
#: child's (label ``connector``).
LOAD_DECISION_COMPUTE_GAUGE = (
    "kvmux_load_decision_compute_seconds_per_token",
    "What the load decision learned the engine pays to compute one prompt token.",
)
LOAD_DECISION_CHILD_GAUGES: dict[str, tuple[str, str]] = {
    "load_s": (
        "kvmux_load_decision_load_seconds",
        "What the load decision learned a child's load costs per request (the fixed part).",
    ),
    "load_s_per_token": (
        "kvmux_load_decision_load_seconds_per_token",
        "What the load decision learned a child's load costs per token.",
    ),
    "not_ready_wait_s": (
        "kvmux_load_decision_not_ready_wait_seconds",
        "What the load decision learned a request waits for a child answering not ready.",
    ),
    "not_ready_yield_tokens": (
        "kvmux_load_decision_not_ready_yield_tokens",
        "What the load decision learned a child's not-ready answers end in: tokens it then "
        "loaded, per request that waited (0 when the wait ended in a miss).",
    ),
}
#: The counters' keys whose values are gauges (replaced, not added).
GAUGES = (BREAKER_STATE, LOAD_DECISION)


#: A child's tier gauges (the host tier's ``tier.<gauge>`` stats, see
#: ``kvmux.host_cache.stats.TIER_GAUGES``): Prometheus gauge (label
#: ``connector``) and help, by gauge. ``tier.group<g>.used_slots`` goes to
#: :data:`TIER_GROUP_GAUGE` (labels ``connector``, ``group``).
TIER_PREFIX = "tier."
TIER_METRICS: dict[str, tuple[str, str]] = {
    "capacity_slots": ("kvmux_tier_capacity_slots", "A tier's capacity in KV blocks (slots)."),
    "capacity_bytes": ("kvmux_tier_capacity_bytes", "A tier's capacity in bytes of host memory."),
    "used_slots": (
        "kvmux_tier_used_slots",
        "A tier's slots holding a KV block (ready, or a save in flight).",
    ),
    "used_bytes": ("kvmux_tier_used_bytes", "Bytes of a tier's slots holding a KV block."),
    "pinned_slots": (
        "kvmux_tier_pinned_slots",
        "A tier's slots an in-flight load or save holds (never evicted).",
    ),
    "tenants": (
        "kvmux_tier_tenants",
        "Tenants (cache_salt values; requests without one are one) holding a tier's blocks.",
    ),
    "protected_slots": (
        "kvmux_tier_protected_slots",
        "A tier's blocks read back, kept over blocks written once (eviction slru).",
    ),
    "protected_target_slots": (
        "kvmux_tier_protected_target_slots",
        "The target a tier's protected blocks adapt to (eviction slru; 0 under lru).",
    ),
    "evicted_share_blocks": (
        "kvmux_tier_evicted_share_blocks",
        "Blocks a tier evicted by the tenant share rule (tenant_max_share), lifetime.",
    ),
    "evicted_protected_blocks": (
        "kvmux_tier_evicted_protected_blocks",
        "Blocks a tier evicted although they were read back (slru), lifetime.",
    ),
}
TIER_GROUP_GAUGE = (
    "kvmux_tier_group_used_slots",
    "A tier's slots holding KV blocks of one KV cache group.",
)


def _tier_gauges(data: Mapping[str, Any]) -> list[tuple[str, str | None, Any]]:
    """(gauge key, KV cache group or None, value) of a child's tier gauges."""
    out: list[tuple[str, str | None, Any]] = []
    for k, v in data.items():
        if not (isinstance(k, str) and k.startswith(TIER_PREFIX)):
            continue
        rest = k[len(TIER_PREFIX) :]
        group, _, gauge = rest.partition(".")
        if gauge and group.startswith("group"):
            out.append((gauge, group[len("group") :], v))
        elif rest in TIER_METRICS:
            out.append((rest, None, v))
    return out


def nested_replace(dst: Nested, src: Mapping[str, Any]) -> Nested:
    """Copy ``src`` into ``dst`` (recursively, in place): the later wins."""
    for k, v in src.items():
        if isinstance(v, Mapping):
            nested_replace(dst.setdefault(k, {}), v)
        else:
            dst[k] = v
    return dst


def nested_add(dst: Nested, src: Mapping[str, Any]) -> Nested:
    """Add ``src``'s numbers into ``dst`` (recursively, in place); gauges
    (:data:`GAUGES`: the breakers' states, what the load decision learned)
    are replaced by the later ones."""
    for k, v in src.items():
        if k in GAUGES and isinstance(v, Mapping):
            nested_replace(dst.setdefault(k, {}), v)
        elif isinstance(v, Mapping):
            nested_add(dst.setdefault(k, {}), v)
        elif isinstance(v, int | float) and not isinstance(v, bool):
            dst[k] = dst.get(k, 0) + v
    return dst


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, int | float]:
    out: dict[str, int | float] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif v:
            out[f"{prefix}{k}"] = v
    return out


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
        logger.warning("kvmux: cannot rebuild child stats of class %s", entry["cls"])
        return None
    return stats_cls(data=dict(entry.get("data") or {}))


@dataclass
class KvmuxStats(KVConnectorStats):
    """kvmux's own counters plus each child's stats, kept per child name."""

    @property
    def counters(self) -> Nested:
        return self.data.setdefault("kvmux", {})

    @property
    def children(self) -> dict[str, KVConnectorStats]:
        return self.data.setdefault("children", {})

    @classmethod
    def rebuild(cls, data: Mapping[str, Any] | None) -> KvmuxStats:
        """From the serialised dict (or a same-process mix of objects)."""
        out = cls()
        if not data:
            return out
        nested_add(out.counters, data.get("kvmux") or {})
        for name, entry in (data.get("children") or {}).items():
            child = _rebuild_child(entry)
            if child is not None:
                out.children[name] = child
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "kvmux": nested_add({}, self.counters),
            "children": {
                name: {"cls": _cls_path(s), "data": s.to_dict()}
                for name, s in self.children.items()
            },
        }

    def aggregate(self, other: KVConnectorStats) -> KvmuxStats:
        if not isinstance(other, KvmuxStats):
            other = KvmuxStats.rebuild(other.data)
        nested_add(self.counters, other.counters)
        for name, s in other.children.items():
            have = self.children.get(name)
            self.children[name] = s if have is None else have.aggregate(s)
        return self

    def reset(self) -> None:
        self.data["kvmux"] = {}
        for s in self.children.values():
            s.reset()

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's periodic log line: ``kvmux.<counter>`` and
        ``<child>.<stat>`` entries, zeros left out."""
        out: dict[str, int | float] = _flatten(self.counters, "kvmux.")
        for name, s in self.children.items():
            if not s.is_empty():
                for k, v in s.reduce().items():
                    out[f"{name}.{k}"] = v
        return out

    def is_empty(self) -> bool:
        return not _flatten(self.counters) and all(s.is_empty() for s in self.children.values())


def build_child_stats(
    names: Sequence[str],
    child_stats: Sequence[KVConnectorStats | None],
    counters: Mapping[str, Any] | None = None,
) -> KvmuxStats | None:
    """One :class:`KvmuxStats` from kvmux's counters of the interval and the
    children's stats; None when there is nothing to report. (Called every
    scheduler step: the common all-quiet case returns at once.)"""
    children = {name: s for name, s in zip(names, child_stats, strict=True) if s is not None}
    if counters:
        return KvmuxStats(data={"kvmux": dict(counters), "children": children})
    if not children or all(s.is_empty() for s in children.values()):
        return None
    # The usual busy step: children's stats only, built in one call.
    return KvmuxStats(data={"children": children})


#: ``take_interval`` (the stats vLLM collects) folds the core's two clash
#: counters into one entry keyed by the ``clash_policy``: ``{"clashes":
#: {"first": 2}}``. A policy either resolves clashes (``first``, ``last``) or
#: raises on them (``error``, ``strict``), so the policy says which of the two
#: counted; the cumulative ``mux_stats()`` keeps the core's two names.
CLASHES = "clashes"
FOLDED_INTO_CLASHES = ("clashes_resolved", "clashes_raised")

#: The multiplexer-wide keys of the interval stats, in the core's order: the
#: core's ``TOTAL_COUNTERS``, the two clash counters folded into ``clashes``.
INTERVAL_TOTALS: tuple[str, ...] = tuple(
    dict.fromkeys(CLASHES if name in FOLDED_INTO_CLASHES else name for name in TOTAL_COUNTERS)
)

#: Prometheus name (exposed with ``_total``) and help of each per-child
#: counter (label ``connector``), by the core's name (``CHILD_COUNTERS``).
CHILD_METRICS: dict[str, tuple[str, str]] = {
    "lookups": ("kvmux_lookups", "Lookups a child answered with a token count."),
    "hits": ("kvmux_lookup_hits", "Lookups in which a child reported matched tokens."),
    "hit_tokens": ("kvmux_lookup_hit_tokens", "Matched tokens children reported on lookups."),
    "loads": ("kvmux_loads", "Requests a child was chosen to load."),
    "load_tokens": (
        "kvmux_loaded_tokens",
        "External tokens allocated for the chosen child to load.",
    ),
    "async_saves": ("kvmux_async_saves", "Finished requests a child saved asynchronously."),
    "contained_errors": (
        "kvmux_contained_errors",
        "Failures of a child on requests it never took part in, contained by kvmux.",
    ),
    "lookup_timeouts": (
        "kvmux_lookup_timeouts",
        "Lookups a child left not ready past its lookup_timeout_ms (treated as a miss).",
    ),
    "lookup_errors": (
        "kvmux_lookup_errors",
        "Lookups a child raised on, contained as a miss (children with a breaker).",
    ),
    "breaker_opens": ("kvmux_breaker_opens", "Times a child's circuit breaker opened."),
    "breaker_skips": (
        "kvmux_breaker_skips",
        "Requests whose lookup skipped a child because its breaker was open.",
    ),
    "served_tokens": (
        "kvmux_served_tokens",
        "Tokens a child supplied to finished requests (failed loads not counted).",
    ),
    "save_completions": (
        "kvmux_save_completions",
        "Async saves a child reported finished, once per request (summed over workers).",
    ),
    "load_completions": (
        "kvmux_load_completions",
        "Async loads a child reported finished or failed (summed over workers).",
    ),
    "stray_completions": (
        "kvmux_stray_completions",
        "Completions a child reported for a request it owed none for (a duplicate, or one "
        "it never saved or loaded): dropped, never passed to vLLM (summed over workers).",
    ),
    "load_timeouts": (
        "kvmux_load_timeouts",
        "Async loads a child left unfinished past its load_timeout_ms (failed for the request).",
    ),
    "load_decisions": (
        "kvmux_load_decisions",
        'Spans of a child the load decision judged with measurements (load_decision "cost").',
    ),
    "declined_slow_load_tokens": (
        "kvmux_declined_slow_load_tokens",
        "Tokens of a child's spans declined: loading them was expected slower than computing "
        "them (recomputed instead).",
    ),
    "declined_slow_wait_tokens": (
        "kvmux_declined_slow_wait_tokens",
        "Tokens declined because a child's not-ready wait was expected to be, or was, longer "
        "than computing them (the most it could offer; recomputed instead).",
    ),
    "declined_saves": (
        "kvmux_declined_saves",
        "Requests whose save a child did not get: save admission (save_policy) declined it "
        "(its blocks were seen too few times and never read back, or the child holds them).",
    ),
    "declined_waits": (
        "kvmux_declined_waits",
        'Requests a child\'s not-ready lookup was not waited for (load_decision "cost": its '
        "wait expected longer than computing, or its recent waits rarely ended in tokens).",
    ),
}

#: The same for the multiplexer-wide counters (no label; ``clashes``: label
#: ``policy``), by their key in the interval stats (``INTERVAL_TOTALS``).
TOTAL_METRICS: dict[str, tuple[str, str]] = {
    "finished": ("kvmux_finished_requests", "Requests finished through kvmux."),
    "extra_cached_tokens": (
        "kvmux_extra_cached_tokens",
        "num_extra_cached_tokens reported: tokens loaded beyond vLLM's local prefix cache.",
    ),
    CLASHES: (
        "kvmux_param_clashes",
        "kv_transfer_params keys returned by two children, by clash_policy.",
    ),
    "extra_async_saves": (
        "kvmux_extra_async_saves",
        "Extra async-save completions workers waited for (k - 1 for k saving children).",
    ),
    "finished_sending": (
        "kvmux_finished_sending",
        "Requests reported finished sending after all their async saves, summed over workers.",
    ),
    "load_failed_blocks": (
        "kvmux_load_failed_blocks",
        "KV blocks children failed to load (vLLM recomputes them), summed over workers.",
    ),
    "local_cached_tokens": (
        "kvmux_local_cached_tokens",
        "Tokens of finished requests that vLLM's local prefix cache held.",
    ),
}


def _described(table: Mapping[str, tuple[str, str]], key: str) -> tuple[str, str]:
    # A counter the core has but the table does not describe is still
    # exported (tests/mux/test_counter_names.py fails until it is described).
    return table.get(key) or (f"kvmux_{key}", f"kvmux counter {key}.")


#: Every ``kvmux_*`` Prometheus counter, derived from the core's counter
#: names: (name, help, key in the ``"kvmux"`` counters, extra label). Label
#: ``"connector"``: ``counters["children"][child][key]``; ``"policy"``:
#: ``counters[key][policy]``; None: ``counters[key]``.
METRICS: tuple[tuple[str, str, str, str | None], ...] = tuple(
    [(*_described(CHILD_METRICS, key), key, "connector") for key in CHILD_COUNTERS]
    + [
        (*_described(TOTAL_METRICS, key), key, "policy" if key == CLASHES else None)
        for key in INTERVAL_TOTALS
    ]
)


def _values(counters: Mapping[str, Any], key: str, label: str | None) -> list[tuple[Any, Any]]:
    if label == "connector":
        return [(child, c.get(key)) for child, c in (counters.get("children") or {}).items()]
    if label == "policy":
        return list((counters.get(key) or {}).items())
    return [(None, counters.get(key))]


#: The Prometheus metrics kvmux registered in this process, by (class, name,
#: label names), so that registering again reuses them.
_COUNTERS: dict[tuple[Any, str, tuple[str, ...]], Any] = {}


class KvmuxPromMetrics(KVConnectorPromMetrics):
    """``kvmux_*`` counters (a ``connector`` label per child, or a ``policy``
    label), the breakers' gauge, the children's tier gauges (``kvmux_tier_*``,
    label ``connector``), plus each child's own metrics, forwarded."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        *,
        children: dict[str, KVConnectorPromMetrics],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children = children
        self._metrics = {
            name: (
                self._registered(
                    self._counter_cls, name, doc, labelnames + ([label] if label else [])
                ),
                key,
                label,
            )
            for name, doc, key, label in METRICS
        }
        self._breaker_gauge = self._registered(
            self._gauge_cls, *BREAKER_GAUGE, [*labelnames, "connector"]
        )
        self._decision_compute_gauge = self._registered(
            self._gauge_cls, *LOAD_DECISION_COMPUTE_GAUGE, labelnames
        )
        self._decision_child_gauges = {
            key: self._registered(self._gauge_cls, name, doc, [*labelnames, "connector"])
            for key, (name, doc) in LOAD_DECISION_CHILD_GAUGES.items()
        }
        self._tier_gauges = {
            key: self._registered(self._gauge_cls, name, doc, [*labelnames, "connector"])
            for key, (name, doc) in TIER_METRICS.items()
        }
        self._tier_group_gauge = self._registered(
            self._gauge_cls, *TIER_GROUP_GAUGE, [*labelnames, "connector", "group"]
        )

    def _registered(self, cls: Any, name: str, doc: str, labelnames: list[str]) -> Any:
        # A metric registers its name once per process: a later engine in
        # the same process (or a second build) reuses the one kvmux made.
        key = (cls, name, tuple(labelnames))
        metric = _COUNTERS.get(key)
        if metric is None:
            metric = cls(name=name, documentation=doc, labelnames=labelnames)
            _COUNTERS[key] = metric
        return metric

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
        engine_labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        counters = transfer_stats_data.get("kvmux") or {}
        for metric, key, label in self._metrics.values():
            for label_value, value in _values(counters, key, label):
                if isinstance(value, int | float) and value > 0:
                    extra = [str(label_value)] if label else []
                    metric.labels(*engine_labels, *extra).inc(value)
        for child, state in (counters.get(BREAKER_STATE) or {}).items():
            if isinstance(state, int | float):
                self._breaker_gauge.labels(*engine_labels, str(child)).set(state)
        learned = counters.get(LOAD_DECISION) or {}
        compute = learned.get("compute_s_per_token")
        if isinstance(compute, int | float):
            self._decision_compute_gauge.labels(*engine_labels).set(compute)
        for child, values in (learned.get("children") or {}).items():
            for key, value in values.items():
                gauge = self._decision_child_gauges.get(key)
                if gauge is not None and isinstance(value, int | float):
                    gauge.labels(*engine_labels, str(child)).set(value)
        for name, entry in (transfer_stats_data.get("children") or {}).items():
            if not isinstance(entry, Mapping):
                continue
            data = entry.get("data") or {}
            for gauge, group, value in _tier_gauges(data):
                if not isinstance(value, int | float):
                    continue
                if group is None:
                    self._tier_gauges[gauge].labels(*engine_labels, str(name)).set(value)
                elif gauge == "used_slots":
                    self._tier_group_gauge.labels(*engine_labels, str(name), group).set(value)
            prom = self._children.get(name)
            if prom is not None:
                prom.observe(data, engine_idx)
