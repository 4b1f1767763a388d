"""The user-facing commands run and say what they found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_scheduler_demo_shows_host_tier_hits_merged_params_and_async_saves():
    proc = run("-m", "kvmux", "demo-scheduler", "--requests", "6")
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "KvmuxHostCache" in out and "ExampleConnector" in out
    assert "'num_extra_cached_tokens': 96" in out
    assert "bit-identical to the saved KV: 6/6" in out
    completions = int(out.split("finished sending: ")[1].split()[0])
    assert completions > 0
    assert out.rstrip().endswith("OK")


def test_gpu_check_runs_its_checks_on_the_cpu(tmp_path):
    """The GPU check script's correctness checks and timings, run on the CPU
    (this machine has no GPU; on one it runs the same code with CUDA)."""
    out_json = tmp_path / "r.json"
    proc = run("benches/gpu_check.py", "--device", "cpu", "--quick", "--json", str(out_json))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CORRECT" in proc.stdout
    import json

    res = json.loads(out_json.read_text())
    assert res["round_trip_blocks_first"] and res["round_trip_kv_first"]
    assert res["d2h_ratio"] > 0 and res["h2d_ratio"] > 0


def test_help_lists_the_engine_demo_and_the_scheduler_demo():
    proc = run("-m", "kvmux", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "demo-scheduler" in proc.stdout and "real vLLM engine" in proc.stdout
