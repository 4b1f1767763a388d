"""Run the comparisons, print the table, write JSON and a PNG plot."""

from __future__ import annotations

import importlib
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benches.overhead import CASES
from benches.overhead.case import Case
from benches.overhead.timing import Progress, Timing, time_pairs

__all__ = ["BLOCK_SIZE_CASES", "Result", "format_table", "run", "write_json", "write_plot"]

#: The cases whose ``build`` takes ``block_size`` (``bench --block-size``);
#: the others run at their own sizes.
BLOCK_SIZE_CASES = ("P3", "P4")


class Result:
    """One row of the table: a case's figure (its only one, or one of its
    ``figures``)."""

    def __init__(
        self, case: Case, timing: Timing, repeats: int, warmup: int, figure_name: str = ""
    ) -> None:
        self.case, self.timing, self.repeats, self.warmup = case, timing, repeats, warmup
        self.figure_name = figure_name

    @property
    def key(self) -> str:
        """The row's name: the case's key, and the figure's (``S1 p99``)."""
        return f"{self.case.key} {self.figure_name}" if self.figure_name else self.case.key

    @property
    def figure(self) -> tuple[float, float, float]:
        """(median, q1, q3) of kvmux/rival, or rival/kvmux for a limit."""
        med, q1, q3 = self.timing.ratio()
        if self.case.higher_is_better:
            return 1 / med, 1 / q3, 1 / q1
        return med, q1, q3

    @property
    def met(self) -> bool | None:
        """Whether the figure meets the target (None: the case has none)."""
        target = self.case.target
        if target is None:
            return None
        fig = self.figure[0]
        return fig >= target if self.case.higher_is_better else fig <= target

    def to_json(self) -> dict[str, Any]:
        c, t = self.case, self.timing
        med, q1, q3 = self.figure
        return {
            "key": self.key,
            "case": c.key,
            "quantity": self.figure_name or None,
            "title": c.title,
            "rival": c.rival_name,
            "unit": c.unit,
            "figure": "rival/kvmux (fraction of the limit)"
            if c.higher_is_better
            else "kvmux/rival",
            "ratio": med,
            "ratio_q1": q1,
            "ratio_q3": q3,
            "target": c.target,
            "target_met": self.met,
            "kvmux_median_s": t.kvmux_median,
            "rival_median_s": t.rival_median,
            "kvmux_spread": t.kvmux_spread,
            "rival_spread": t.rival_spread,
            "kvmux_s": t.kvmux,
            "rival_s": t.rival,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "inner": c.inner,
            "notes": c.notes,
        }


def _fmt_time(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def run(
    keys: Sequence[str],
    *,
    quick: bool,
    repeats: int | None = None,
    warmup: int | None = None,
    progress: Progress | None = None,
    block_size: int | None = None,
) -> list[Result]:
    """``block_size``: tokens per KV block for :data:`BLOCK_SIZE_CASES`
    (None: each case's default, 16)."""
    progress = progress or Progress()
    default_reps = 5 if quick else 25
    default_warm = 1 if quick else 3
    out: list[Result] = []
    for key in keys:
        t0 = time.monotonic()
        progress.note(f"{key}: setting up")
        sized = {"block_size": block_size} if block_size and key in BLOCK_SIZE_CASES else {}
        case: Case = importlib.import_module(CASES[key]).build(quick, **sized)
        reps = repeats if repeats is not None else min(default_reps, case.repeats or default_reps)
        warm = warmup if warmup is not None else min(default_warm, case.warmup or default_warm)
        if case.check is not None:
            progress.note(f"{key}: checking that both sides do the same work")
            case.check()
        progress.note(f"{key}: {case.title}: {warm} warm-up + {reps} repeats x {case.inner}")
        timings = time_pairs(
            case.kvmux,
            case.rival,
            inner=case.inner,
            repeats=reps,
            warmup=warm,
            label=key,
            progress=progress,
            self_timed=case.self_timed or bool(case.figures),
        )
        if case.figures:
            if sorted(timings) != sorted(case.figures):
                raise RuntimeError(f"{key} reported {sorted(timings)}, not {list(case.figures)}")
            out.extend(Result(case, timings[f], reps, warm, f) for f in case.figures)
        else:
            out.append(Result(case, timings[""], reps, warm))
        progress.note(f"{key}: done in {time.monotonic() - t0:.1f} s")
    return out


def format_table(results: Sequence[Result]) -> str:
    head = (
        "case",
        "what",
        "kvmux median",
        "spread",
        "rival median",
        "spread",
        "ratio [IQR]",
        "target",
        "met",
    )
    rows = [head]
    for r in results:
        c, t = r.case, r.timing
        med, q1, q3 = r.figure
        rows.append(
            (
                r.key,
                c.title,
                _fmt_time(t.kvmux_median),
                f"{100 * t.kvmux_spread:.0f}%",
                _fmt_time(t.rival_median),
                f"{100 * t.rival_spread:.0f}%",
                f"{med:.3f} [{q1:.3f}-{q3:.3f}]",
                "-"
                if c.target is None
                else ("≥ " if c.higher_is_better else "≤ ") + f"{c.target:g}",
                {None: "-", True: "yes", False: "NO"}[r.met],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    footed = set()
    for r in results:
        c = r.case
        if c.key in footed:
            continue
        footed.add(c.key)
        figure = "rival time / kvmux time" if c.higher_is_better else "kvmux time / rival time"
        lines.append(f"{c.key}: per op = {c.unit}; rival = {c.rival_name}; ratio = {figure}")
        lines.extend(c.footer)
    lines.append(
        "ratio: median of per-repeat paired ratios [interquartile range]; "
        "spread: IQR / median of the times"
    )
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    import os

    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001 - informational only
        info["vllm"] = None
    return info


def write_json(path: str | Path, results: Sequence[Result], argv: Sequence[str]) -> None:
    doc = {
        "command": " ".join(["python", "-m", "benches.overhead", *argv]),
        "environment": environment(),
        "results": [r.to_json() for r in results],
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def write_plot(path: str | Path, results: Sequence[Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.9 * len(results) + 1.5))
    labels, ys = [], []
    for i, r in enumerate(results):
        c = r.case
        med, q1, q3 = r.figure
        y = len(results) - 1 - i
        ys.append(y)
        labels.append(f"{r.key} vs {c.rival_name}\n{c.title}")
        color = {None: "tab:blue", True: "tab:green", False: "tab:red"}[r.met]
        ax.barh(y, med, xerr=[[med - q1], [q3 - med]], color=color)
        if c.target is not None:
            ax.plot([c.target, c.target], [y - 0.45, y + 0.45], color="black", linestyle="--")
        ax.text(med, y, f"  {med:.3f}", va="center")
    ax.set_yticks(ys, labels, fontsize=7)
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel(
        "ratio (P1-P3, P1h, S1, C1: kvmux/rival, lower is better; P4: fraction of the limit)"
    )
    ax.set_title("kvmux vs rivals, same run (dashed: target)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
