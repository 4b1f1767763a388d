"""CPU time over a benchmark's workload, from Linux's ``/proc``: how busy
the machine's cores were, and how much of that went to each named group of
processes (the engines, the LMCache servers, Redis).

A shared store costs CPU that no load decision controls: every save is
serialized and written by the LMCache server and stored by Redis, on the
same cores that compute prompts. :class:`CpuMeter` measures that share, so a
benchmark can say what a gap is made of rather than guess.

Each group is a list of process group ids (every server here is started in
a process group of its own, its children with it): its CPU is the user and
system time of the group's live processes, read at :meth:`CpuMeter.start`
and :meth:`CpuMeter.stop`. A process that exits in between takes its time
with it (none of the servers do while the workload runs). Elsewhere than
Linux every figure is ``None``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["CpuMeter", "format_cpu", "group_cpu_s", "machine_busy_s"]

PROC = Path("/proc")


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def machine_busy_s() -> float | None:
    """CPU seconds all cores spent busy since boot (not idle, not waiting
    on I/O), from ``/proc/stat``; None where it cannot be read."""
    try:
        first = (PROC / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if first[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice]:
    # guest time is already counted in user.
    v = [int(x) for x in first[1:9]]
    return (sum(v) - v[3] - v[4]) / _ticks()


def group_cpu_s(pgid: int) -> float | None:
    """User plus system CPU seconds of the live processes in process group
    ``pgid``; None where ``/proc`` cannot be read."""
    if not PROC.is_dir():
        return None
    total = 0
    for d in PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, cut after ')'.
        rest = stat[stat.rfind(")") + 2 :].split()
        if int(rest[2]) == pgid:
            total += int(rest[11]) + int(rest[12])  # utime, stime
    return total / _ticks()


class CpuMeter:
    """The machine's busy CPU seconds and each group's, between
    :meth:`start` and :meth:`stop`."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self._t0 = 0.0
        self._busy0: float | None = None
        self._group0: dict[str, float | None] = {}

    def _groups_now(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name, pgids in self.groups.items():
            xs = [group_cpu_s(p) for p in pgids]
            out[name] = None if any(x is None for x in xs) else sum(x or 0.0 for x in xs)
        return out

    def start(self) -> CpuMeter:
        self._t0 = time.perf_counter()
        self._busy0 = machine_busy_s()
        self._group0 = self._groups_now()
        return self

    def stop(self) -> dict[str, Any]:
        """``wall_s``, ``cpus``, ``busy_s`` (all cores) and ``groups``
        (seconds per group), each ``None`` where it could not be read."""
        wall = time.perf_counter() - self._t0
        busy = machine_busy_s()
        now = self._groups_now()
        groups: dict[str, float | None] = {}
        for name, v in now.items():
            v0 = self._group0.get(name)
            groups[name] = None if v is None or v0 is None else max(0.0, v - v0)
        return {
            "wall_s": wall,
            "cpus": os.cpu_count(),
            "busy_s": None if busy is None or self._busy0 is None else busy - self._busy0,
            "groups": groups,
        }


def format_cpu(c: dict[str, Any] | None) -> str | None:
    """One line: the cores' busy share over the workload and each group's
    CPU seconds with its share of the busy time."""
    if not c or c.get("busy_s") is None:
        return None
    busy, wall, cpus = c["busy_s"], c["wall_s"], c["cpus"] or 1
    parts = [
        f"cpu over the workload: {busy:.1f} s busy of {wall:.1f} s x {cpus} cores "
        f"({100 * busy / (wall * cpus):.0f}%)"
    ]
    known = {k: v for k, v in c["groups"].items() if v is not None}
    known["the rest (client, OS)"] = max(0.0, busy - sum(known.values()))
    for name, s in known.items():
        share = f" ({100 * s / busy:.0f}%)" if busy > 0 else ""
        parts.append(f"{name} {s:.1f} s{share}")
    return "; ".join(parts)
