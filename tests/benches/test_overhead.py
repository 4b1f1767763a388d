"""The overhead comparisons (``python -m benches.overhead``, from the
repository root): each case runs and the table, JSON and plot come out. No
timing ratio is asserted."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

import benches.overhead as overhead
from benches.overhead import CASES, command, runner
from kvmux.bench.lmcache import CHUNK_SIZE, refused
from tests.support import sim

ROOT = Path(__file__).resolve().parents[2]
#: The bench lists C1L (C1 with a real LMCache server) only where LMCache is
#: installed, and runs it only where kvmux does not refuse LMCache (lmcache
#: 0.5.6 on vLLM 0.34: the bench says why on stderr).
LMCACHE_REFUSED = "C1L" in CASES and refused() is not None
WITH_LMCACHE = "C1L" in CASES and not LMCACHE_REFUSED


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_bench_quick_runs_every_comparison_and_prints_its_table(tmp_path):
    """CI smoke test of ``python -m benches.overhead --quick``: it runs each
    comparison and prints the table, JSON and plot. It asserts no timing
    ratio: this machine is too noisy for that (see benches/RESULTS.md). S1's
    waits are set by the case itself (a 250 ms stall against a 50 ms
    deadline), so there it checks that the rival waited out the stall and
    kvmux did not."""
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run("-m", "benches.overhead", "--quick", "--json", str(out_json), "--plot", str(out_png))
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
    assert doc["command"].startswith("python -m benches.overhead --quick")
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
    monkeypatch.setitem(overhead.UNAVAILABLE, "C1L", why)
    monkeypatch.delitem(overhead.CASES, "C1L", raising=False)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    with pytest.raises(SystemExit, match=r"bench C1L cannot run here: LMCache is not installed"):
        command.run(parser.parse_args(["--only", "C1L"]))
    ran: list[list[str]] = []
    monkeypatch.setattr(runner, "run", lambda keys, **kw: ran.append(list(keys)) or [])
    monkeypatch.setattr(runner, "format_table", lambda results: "")
    assert command.run(parser.parse_args([])) == 0
    assert ran == [list(overhead.CASES)] and "C1L" not in ran[0]
    assert f"bench C1L skipped: {why}" in capsys.readouterr().err


def test_the_lmcache_server_chunks_at_the_simulator_block_size():
    """The launcher (in the wheel) cannot import the simulator (outside it):
    its default chunk size is a constant that must stay the simulator's
    block size, as LMCache requires of C1L and the tests."""
    assert CHUNK_SIZE == sim.BLOCK_SIZE
