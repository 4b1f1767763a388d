"""The user-facing commands run and say what they found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_scheduler_demo_shows_host_tier_hits_merged_params_and_async_saves():
    proc = run("-m", "tests.support.demo_scheduler", "--requests", "6")
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


def test_help_lists_the_engine_demo_doctor_and_bench():
    proc = run("-m", "kvmux", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "real vLLM engine" in proc.stdout
    assert "doctor" in proc.stdout and "bench" in proc.stdout
    assert "demo-scheduler" not in proc.stdout  # test scaffolding: tests/support/demo_scheduler.py


def test_bench_without_a_group_points_to_the_overhead_comparisons_and_exits_2():
    """``python -m kvmux bench`` runs ``serve`` or ``fleet``; with no group it
    says where the overhead comparisons went (a source checkout's
    ``python -m benches.overhead``) and imports nothing of the development
    code (``benches``, ``tests``), even run from the repository root."""
    script = (
        "import sys\n"
        "from kvmux.cli import main\n"
        "rc = main(['bench'])\n"
        "dev = sorted(m for m in sys.modules if m.split('.')[0] in ('benches', 'tests'))\n"
        "print('DEV', dev)\n"
        "sys.exit(rc)\n"
    )
    proc = run("-c", script)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DEV []" in proc.stdout
    assert "development benchmarks" in proc.stderr
    assert "python -m benches.overhead" in proc.stderr
    assert "serve" in proc.stderr and "fleet" in proc.stderr
    proc = run("-m", "kvmux", "bench")
    assert proc.returncode == 2 and "python -m benches.overhead" in proc.stderr


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--only", "P1"], "--only"), (["serve", "--block-size", "64"], "--block-size")],
)
def test_bench_with_the_overhead_flags_says_where_they_moved(flags, named):
    """An old command line (``python -m kvmux bench --only P1``) gets the same
    pointer, naming the flags, not argparse's "unrecognized arguments"."""
    proc = run("-m", "kvmux", "bench", *flags)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{named}: flags of the overhead comparisons, which moved" in proc.stderr
    assert "python -m benches.overhead" in proc.stderr


def test_bench_fleet_refuses_a_serve_only_workload_with_the_choices():
    """``--workload host-fits`` / ``spill`` are bench serve's; fleet names
    the workloads it runs instead of failing with a KeyError."""
    proc = run("-m", "kvmux", "bench", "fleet", "--workload", "spill", "--quick")
    assert proc.returncode != 0
    assert "bench fleet: --workload spill is a bench serve workload" in proc.stderr
    assert "fleet runs chat, pays" in proc.stderr
