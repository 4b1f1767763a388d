"""kvmux's counter names have one source, the Rust core
(``kvmux._core.CHILD_COUNTERS`` and ``TOTAL_COUNTERS``, from
``rust/mux/stats.rs``): the stats keys, the ``kvmux_*`` Prometheus table and the
metric table of docs/metrics.md agree with it. Every core counter is exported; nothing
is exported or documented that the core does not count. The one deliberate
difference: the interval stats fold ``clashes_resolved`` and
``clashes_raised`` into ``clashes``, keyed by the clash policy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvmux._core import CHILD_COUNTERS, TOTAL_COUNTERS
from kvmux.mux.stats import (
    CHILD_METRICS,
    CLASHES,
    FOLDED_INTO_CLASHES,
    INTERVAL_TOTALS,
    METRICS,
    TOTAL_METRICS,
)

# vLLM's load rule on the simulator: see conftest.
pytestmark = pytest.mark.usefixtures("vllms_load_rule")

METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

#: What the interval stats hold beside the core's totals: the per-child rows.
CHILDREN = "children"
#: What ``mux_stats()`` adds to the core's cumulative counters.
MUX_STATS_EXTRAS = {"live_requests", "pending_async_saves", "breakers", "save_table_blocks"}


def expected_interval_totals() -> list[str]:
    """The core's totals with the clash fold applied, written out here on
    its own so that the fold in ``kvmux.mux.stats`` is checked, not trusted."""
    out: list[str] = []
    for name in TOTAL_COUNTERS:
        key = CLASHES if name in ("clashes_resolved", "clashes_raised") else name
        if key not in out:
            out.append(key)
    return out


def test_the_core_exports_distinct_names():
    assert CHILD_COUNTERS and TOTAL_COUNTERS
    assert len(set(CHILD_COUNTERS)) == len(CHILD_COUNTERS)
    assert len(set(TOTAL_COUNTERS)) == len(TOTAL_COUNTERS)
    assert CHILDREN not in TOTAL_COUNTERS and CLASHES not in TOTAL_COUNTERS


def test_the_clash_fold_names_counters_the_core_has():
    assert set(FOLDED_INTO_CLASHES) <= set(TOTAL_COUNTERS), (
        "kvmux.mux.stats folds clash counters the core no longer has",
        FOLDED_INTO_CLASHES,
        TOTAL_COUNTERS,
    )
    assert list(INTERVAL_TOTALS) == expected_interval_totals()


def test_every_core_counter_has_a_described_prometheus_metric_and_no_other():
    assert set(CHILD_METRICS) == set(CHILD_COUNTERS), set(CHILD_METRICS) ^ set(CHILD_COUNTERS)
    assert set(TOTAL_METRICS) == set(INTERVAL_TOTALS), set(TOTAL_METRICS) ^ set(INTERVAL_TOTALS)
    by_key = {(key, label): name for name, _, key, label in METRICS}
    assert by_key == {
        **{(k, "connector"): CHILD_METRICS[k][0] for k in CHILD_COUNTERS},
        **{
            (k, "policy" if k == CLASHES else None): TOTAL_METRICS[k][0]
            for k in expected_interval_totals()
        },
    }
    names = [name for name, *_ in METRICS]
    assert len(set(names)) == len(names), "two counters share a Prometheus name"
    assert all(re.fullmatch(r"kvmux_[a-z_]+", n) and not n.endswith("_total") for n in names)


def readme_metrics() -> dict[str, str]:
    """``kvmux_*_total`` -> its labels, from the metric table of docs/metrics.md."""
    text = METRICS_PAGE.read_text()
    head = text.index("| metric | labels | meaning |")
    rows: dict[str, str] = {}
    for line in text[head:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0].strip("`")
        assert name not in rows, f"docs/metrics.md lists {name} twice"
        rows[name] = cells[1]
    return rows


def test_the_readme_lists_exactly_the_exported_metrics():
    documented = readme_metrics()
    exported = {f"{name}_total": label or "" for name, _, _, label in METRICS}
    assert set(documented) == set(exported), (
        "docs/metrics.md metric table vs kvmux.mux.stats.METRICS",
        sorted(set(documented) ^ set(exported)),
    )
    assert documented == exported, "labels differ"


def test_the_cumulative_stats_are_named_by_the_core(driver_factory, h):
    d = driver_factory(h.mux_config([h.scripted(), h.scripted()]))
    stats = d.connector.mux_stats()
    assert set(stats) - MUX_STATS_EXTRAS - {CHILDREN} == set(TOTAL_COUNTERS)
    assert set(stats[CHILDREN]) == {"ScriptedConnector#0", "ScriptedConnector#1"}
    for row in stats[CHILDREN].values():
        assert set(row) == set(CHILD_COUNTERS)


@pytest.mark.parametrize("policy", ["first", "last"])
def test_the_interval_stats_fold_the_clash_counters_by_policy(driver_factory, h, policy):
    """What vLLM collects per interval: the core's names, the clashes under
    ``clashes`` by policy, and every key a ``kvmux_*`` metric reads."""
    d = driver_factory(
        h.mux_config(
            [
                h.scripted(params={"k": 1}, async_save=True),
                h.scripted(params={"k": 2}, async_save=True),
            ],
            clash_policy=policy,
        )
    )
    for i in range(3):
        d.add(f"r{i}", list(range(20)))
    d.run()
    assert d.connector.mux_stats()["clashes_resolved"] == 3
    keys: set[str] = set()
    child_keys: set[str] = set()
    clashes = 0
    for payload in d.kv_stats:
        counters = payload.get("kvmux") or {}
        keys |= set(counters)
        for row in (counters.get(CHILDREN) or {}).values():
            child_keys |= set(row)
        clashes += (counters.get(CLASHES) or {}).get(policy, 0)
    assert clashes == 3
    assert not keys & set(FOLDED_INTO_CLASHES)
    assert keys - {CHILDREN} <= set(INTERVAL_TOTALS), keys
    assert child_keys <= set(CHILD_COUNTERS), child_keys
    # The workload reaches more than the trivial counters.
    assert {"finished", CLASHES, "extra_async_saves", "finished_sending"} <= keys
    assert {"lookups", "async_saves"} <= child_keys
