"""kvmux.bench.cpu against real processes: a process group that burns CPU
is charged its seconds, an idle one none, and the line the benchmarks print
names each group with its share and the rest."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvmux.bench.cpu import CpuMeter, format_cpu, group_cpu_s, machine_busy_s

pytestmark = pytest.mark.skipif(
    machine_busy_s() is None, reason="needs Linux's /proc (the benchmarks' machines)"
)

BURN = "import time\nend = time.perf_counter() + 1.0\nwhile time.perf_counter() < end: pass\n"
IDLE = "import time\ntime.sleep(1.0)\n"


def _group(code: str) -> subprocess.Popen[bytes]:
    """A Python process in a process group of its own (as the benchmarks
    start their servers)."""
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_a_busy_group_is_charged_and_an_idle_one_is_not() -> None:
    burn, idle = _group(BURN), _group(IDLE)
    try:
        meter = CpuMeter({"burner": [burn.pid], "sleeper": [idle.pid]}).start()
        time.sleep(0.8)
        c = meter.stop()
    finally:
        burn.wait(timeout=30)
        idle.wait(timeout=30)
    g = c["groups"]
    # Even on a loaded 2-core machine a spinning process gets a fair share.
    assert g["burner"] is not None and g["burner"] > 0.2
    assert g["sleeper"] is not None and g["sleeper"] < 0.1
    assert c["busy_s"] is not None and c["busy_s"] >= g["burner"] - 0.05
    assert c["busy_s"] <= c["wall_s"] * (c["cpus"] or 1) + 0.1
    line = format_cpu(c)
    assert line is not None
    assert "burner" in line and "sleeper" in line and "the rest (client, OS)" in line
    assert line.startswith("cpu over the workload:")


def test_a_group_with_no_process_costs_nothing() -> None:
    done = _group("pass")
    done.wait(timeout=30)
    assert group_cpu_s(done.pid) == 0.0


def test_nothing_printed_without_a_measurement() -> None:
    assert format_cpu(None) is None
    assert format_cpu({"busy_s": None, "wall_s": 1.0, "cpus": 2, "groups": {}}) is None
