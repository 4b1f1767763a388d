"""The user-facing commands run and say what they found."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvmux import bench
from kvmux.bench import CASES, runner
from kvmux.bench.lmcache import refused
from kvmux.cli import bench as cli_bench

ROOT = Path(__file__).resolve().parents[2]
#: The bench lists C1L (C1 with a real LMCache server) only where LMCache is
#: installed, and runs it only where kvmux does not refuse LMCache (lmcache
#: 0.5.6 on vLLM 0.34: ``bench`` says why on stderr).
LMCACHE_REFUSED = "C1L" in CASES and refused() is not None
WITH_LMCACHE = "C1L" in CASES and not LMCACHE_REFUSED


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


def test_bench_quick_runs_every_comparison_and_prints_its_table(tmp_path):
    """CI smoke test of ``python -m kvmux bench --quick``: it runs each
    comparison and prints the table, JSON and plot. It asserts no timing
    ratio: this machine is too noisy for that (see benches/RESULTS.md). S1's
    waits are set by the case itself (a 250 ms stall against a 50 ms
    deadline), so there it checks that the rival waited out the stall and
    kvmux did not."""
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run("-m", "kvmux", "bench", "--quick", "--json", str(out_json), "--plot", str(out_png))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if LMCACHE_REFUSED:
        assert "bench C1L skipped: kvmux refuses LMCache" in proc.stderr
        assert "resumed_req_ids" in proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("case"))
    assert "kvmux median" in header and "ratio" in header and "spread" in header
    for key, rival in (
        ("P1", "MultiConnector"),
        ("P2", "MultiConnector"),
        ("P3", "SimpleCPUOffloadConnector"),
        ("P4", "plain contiguous torch copy"),
        ("P1h", "MultiConnector"),
        ("S1", "MultiConnector"),
        ("C1", "load_policy first"),
        *((("C1L", "load_policy first"),) if WITH_LMCACHE else ()),
    ):
        assert any(line.startswith(key + " ") for line in proc.stdout.splitlines()), key
        assert f"{key}: per op" in proc.stdout and rival in proc.stdout
    import json

    doc = json.loads(out_json.read_text())
    results = {r["key"]: r for r in doc["results"]}
    assert list(results) == [
        "P1",
        "P2",
        "P3",
        "P4",
        "P1h",
        "S1 p50",
        "S1 p99",
        "C1 vs first",
        "C1 vs longest",
        *(["C1L vs first", "C1L vs longest"] if WITH_LMCACHE else []),
    ]
    p1h = results["P1h"]
    assert p1h["target"] is None and p1h["notes"]["host_lookup_hits"] > 0
    # S1: time to schedule, p50 and p99, for both sides, in rows of their own.
    for q in ("p50", "p99"):
        row = results[f"S1 {q}"]
        assert row["case"] == "S1" and row["quantity"] == q
        assert any(line.startswith(f"S1 {q} ") for line in proc.stdout.splitlines())
        assert len(row["kvmux_s"]) == len(row["rival_s"]) == row["repeats"] > 0
        assert min(row["rival_s"]) >= row["notes"]["stall_ms"] / 1000  # waited out the stall
        assert row["kvmux_median_s"] < row["rival_median_s"]  # the deadline cut it short
    assert results["S1 p50"]["notes"]["kvmux_lookup_timeouts"] > 0
    # C1: compose against first and longest, the bytes each tier moved.
    for rival in ("first", "longest"):
        row = results[f"C1 vs {rival}"]
        assert row["case"] == "C1" and row["quantity"] == f"vs {rival}"
        assert any(line.startswith(f"C1 vs {rival} ") for line in proc.stdout.splitlines())
        assert len(row["kvmux_s"]) == len(row["rival_s"]) == row["repeats"] > 0
    moved = results["C1 vs first"]["notes"]["moved"]
    half = moved["compose"]["bytes_loaded"]["host"]
    assert half > 0 and moved["compose"]["bytes_loaded"]["tier2"] == half  # [0, a), [a, b)
    assert moved["first"]["bytes_loaded"] == {"host": half, "tier2": 0}
    assert moved["longest"]["bytes_loaded"] == {"host": 0, "tier2": 2 * half}
    assert moved["first"]["recomputed_tokens"] > moved["compose"]["recomputed_tokens"]
    for policy in ("compose", "first", "longest"):
        assert any(line.startswith(f"C1 {policy} ") for line in proc.stdout.splitlines())
    if WITH_LMCACHE:
        # C1L: C1 with the real LMCache server as the second tier (started
        # and stopped by the case).
        moved = results["C1L vs first"]["notes"]["moved"]
        assert results["C1L vs first"]["notes"]["children"]["tier2"] == "LMCacheMPConnector"
        assert moved["compose"]["load_tokens"]["tier2"] == moved["compose"]["load_tokens"]["host"]
        assert moved["longest"]["load_tokens"] == {
            "host": 0,
            "tier2": 2 * moved["compose"]["load_tokens"]["tier2"],
        }
        assert len(results["C1L vs longest"]["kvmux_s"]) == results["C1L vs longest"]["repeats"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_names_a_case_that_cannot_run_here(monkeypatch, capsys):
    """A case this machine cannot run (C1L without LMCache) is refused under
    ``--only`` with the reason, not argparse's bare "invalid choice", and
    named on stderr when every other case runs."""
    why = "LMCache is not installed (pip install lmcache; tested: 0.5.6)"
    monkeypatch.setitem(bench.UNAVAILABLE, "C1L", why)
    monkeypatch.delitem(bench.CASES, "C1L", raising=False)
    parser = argparse.ArgumentParser()
    cli_bench.add_arguments(parser)
    with pytest.raises(SystemExit, match=r"bench C1L cannot run here: LMCache is not installed"):
        cli_bench.run(parser.parse_args(["--only", "C1L"]))
    ran: list[list[str]] = []
    monkeypatch.setattr(runner, "run", lambda keys, **kw: ran.append(list(keys)) or [])
    monkeypatch.setattr(runner, "format_table", lambda results: "")
    assert cli_bench.run(parser.parse_args([])) == 0
    assert ran == [list(bench.CASES)] and "C1L" not in ran[0]
    assert f"bench C1L skipped: {why}" in capsys.readouterr().err
