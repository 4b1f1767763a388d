"""What one comparison hands the runner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case"]


@dataclass
class Case:
    key: str
    """Short id: P1..P4, P1h, S1, C1."""
    title: str
    kvmux: Callable[[], object]
    """One operation through kvmux."""
    rival: Callable[[], object]
    """The same operation through the rival, on the same children and inputs."""
    rival_name: str
    unit: str
    """What one operation is (printed beside the times)."""
    target: float | None
    """The figure kvmux aims for (None: reported, no target)."""
    higher_is_better: bool = False
    """False: the figure is kvmux time / rival time (lower is better). True:
    it is rival time / kvmux time, kvmux's fraction of a limit (P4)."""
    inner: int = 1
    """Operations per timed repeat."""
    self_timed: bool = False
    """True: ``kvmux`` and ``rival`` return the seconds to count (the part of
    their work being compared), instead of being timed whole."""
    figures: tuple[str, ...] = ()
    """Names of several figures one self-timed run reports (S1: ``("p50",
    "p99")``): ``kvmux`` and ``rival`` then return a dict of seconds by name,
    and the table has one row per figure (``S1 p50``, ``S1 p99``). Empty: one
    figure, the time (or the seconds returned)."""
    repeats: int | None = None
    """At most this many timed repeats per side unless ``--repeats`` says
    (None: the bench's default; a case whose repeats take seconds sets fewer)."""
    warmup: int | None = None
    """At most this many untimed repeats per side unless ``--warmup`` says."""
    check: Callable[[], None] | None = None
    """Raises if the two sides did not do the same work (run once, untimed)."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Sizes and the code paths timed, for the JSON and the table's footer."""
    footer: list[str] = field(default_factory=list)
    """Lines printed under the table after the case's own (C1: the bytes each
    tier moved per configuration); ``check`` may fill them."""
