"""Paired, interleaved timing: kvmux and its rival measured in one process,
repeat by repeat, so the noise of a busy machine hits both alike."""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Progress", "Timing", "time_pair", "time_pairs"]


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


@dataclass
class Timing:
    """Seconds per operation of each repeat, for kvmux and for the rival."""

    kvmux: list[float]
    rival: list[float]

    def _stat(self, xs: list[float]) -> tuple[float, float]:
        q1, med, q3 = _quantiles(xs)
        return med, (q3 - q1) / med if med else 0.0

    @property
    def kvmux_median(self) -> float:
        return self._stat(self.kvmux)[0]

    @property
    def rival_median(self) -> float:
        return self._stat(self.rival)[0]

    @property
    def kvmux_spread(self) -> float:
        """Interquartile range over the median."""
        return self._stat(self.kvmux)[1]

    @property
    def rival_spread(self) -> float:
        return self._stat(self.rival)[1]

    def ratios(self) -> list[float]:
        """kvmux time / rival time, per repeat (the pair ran back to back)."""
        return [k / r for k, r in zip(self.kvmux, self.rival, strict=True)]

    def ratio(self) -> tuple[float, float, float]:
        """Median of the paired ratios and its interquartile range."""
        q1, med, q3 = _quantiles(self.ratios())
        return med, q1, q3


class Progress:
    """One line per event on stderr; on a terminal, a live counter."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def note(self, text: str) -> None:
        if self.enabled:
            print(("\r\033[K" if self.tty else "") + text, file=sys.stderr, flush=True)

    def tick(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < (0.2 if self.tty else 5.0):
            return
        self._last = now
        text = f"  {label}: repeat {done}/{total}"
        if self.tty:
            print("\r\033[K" + text, end="" if done < total else "\n", file=sys.stderr, flush=True)
        elif done < total:
            print(text, file=sys.stderr, flush=True)


def _run(fn: Callable[[], object], inner: int, self_timed: bool = False) -> dict[str, float]:
    """Seconds per call by figure name ("" when ``fn`` reports one)."""
    if self_timed:  # fn returns the seconds that count, or a dict of them
        outs: list[Any] = [fn() for _ in range(inner)]  # all floats or all dicts
        if isinstance(outs[0], dict):
            return {k: sum(float(o[k]) for o in outs) / inner for k in outs[0]}
        return {"": sum(float(o) for o in outs) / inner}
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return {"": (time.perf_counter() - t0) / inner}


def time_pair(
    kvmux: Callable[[], object],
    rival: Callable[[], object],
    *,
    inner: int,
    repeats: int,
    warmup: int,
    label: str = "",
    progress: Progress | None = None,
    self_timed: bool = False,
) -> Timing:
    """Time ``inner`` calls of each function per repeat, alternating which
    goes first, after ``warmup`` untimed repeats of both. The garbage
    collector is off while timing (as in ``timeit``). ``self_timed``: each
    call returns the seconds that count."""
    return time_pairs(
        kvmux,
        rival,
        inner=inner,
        repeats=repeats,
        warmup=warmup,
        label=label,
        progress=progress,
        self_timed=self_timed,
    )[""]


def time_pairs(
    kvmux: Callable[[], object],
    rival: Callable[[], object],
    *,
    inner: int,
    repeats: int,
    warmup: int,
    label: str = "",
    progress: Progress | None = None,
    self_timed: bool = False,
) -> dict[str, Timing]:
    """:func:`time_pair` for self-timed functions that may report several
    figures per call (a dict of seconds by name): one :class:`Timing` per
    figure, from the same repeats (``""``: the one figure of a plain call)."""
    for _ in range(warmup):
        _run(kvmux, inner, self_timed)
        _run(rival, inner, self_timed)
    out: dict[str, Timing] = {}

    def add(side: str, got: dict[str, float]) -> None:
        for name, secs in got.items():
            getattr(out.setdefault(name, Timing([], [])), side).append(secs)

    gc_was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            if r % 2:
                add("rival", _run(rival, inner, self_timed))
                add("kvmux", _run(kvmux, inner, self_timed))
            else:
                add("kvmux", _run(kvmux, inner, self_timed))
                add("rival", _run(rival, inner, self_timed))
            if progress is not None:
                progress.tick(label, r + 1, repeats)
    finally:
        if gc_was_on:
            gc.enable()
    return out
