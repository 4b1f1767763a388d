"""Where the time to first token goes, per request, from the timeline kvmux
writes when its config has ``"timeline_path"``: one JSON line per finished
request (written at ``request_finished``, all times epoch seconds on vLLM's
``Request.arrival_time`` clock, ``null`` for what did not happen).

Phases of one request:

- queue: ``arrival`` -> ``first_lookup`` (vLLM asked kvmux the first time);
- lookup wait: ``first_lookup`` -> ``ready`` (kvmux answered with a count;
  every "not ready" answer before costs the request one engine step);
- admit: ``ready`` -> ``allocated`` (vLLM allocated the blocks);
- load: ``allocated`` -> the latest ``load_done`` of a child that loaded
  (``load_tokens > 0``); none when nothing was loaded;
- compute: the load's end (or ``allocated`` when nothing was loaded) ->
  ``first_token`` (the step that computed the last prompt token);
- total: ``arrival`` -> ``first_token``.

Pure functions over parsed lines (:func:`load`, :func:`breakdown`,
:func:`format_breakdown`); the benchmarks (``bench serve``, ``bench fleet``)
call them per system.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MIN_PROMPT_TOKENS", "PHASES", "breakdown", "format_breakdown", "load"]

#: Lines with fewer prompt tokens are the benches' warm-up requests (32
#: tokens), not the workload: dropped.
MIN_PROMPT_TOKENS = 64
PHASES = ("queue", "lookup_wait", "admit", "load", "compute", "total")
REASONS = ("slow_load", "slow_wait")


def load(path: str | Path) -> list[dict[str, Any]]:
    """The parsed lines of the timeline file ``path`` ([] if it does not
    exist). A line that is not a JSON object (a write cut short) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    out: list[dict[str, Any]] = []
    for text in p.read_text(errors="replace").splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict):
            out.append(line)
    return out


def _pct(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` (0..1); None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def phases(line: dict[str, Any]) -> dict[str, float | None]:
    """One request's phases in seconds (None where an end is missing)."""
    allocated = line.get("allocated")
    ends = [
        c["load_done"]
        for c in line.get("children") or []
        if (c.get("load_tokens") or 0) > 0 and c.get("load_done") is not None
    ]
    load_end = max(ends) if ends else None
    compute_start = load_end if load_end is not None else allocated
    return {
        "queue": _diff(line.get("arrival"), line.get("first_lookup")),
        "lookup_wait": _diff(line.get("first_lookup"), line.get("ready")),
        "admit": _diff(line.get("ready"), allocated),
        "load": _diff(allocated, load_end),
        "compute": _diff(compute_start, line.get("first_token")),
        "total": _diff(line.get("arrival"), line.get("first_token")),
    }


def recomputed_tokens(line: dict[str, Any]) -> int:
    """Prompt tokens neither vLLM's prefix cache nor a child provided."""
    return max(
        0,
        int(line.get("prompt_tokens") or 0)
        - int(line.get("local_hit_tokens") or 0)
        - int(line.get("external_tokens") or 0),
    )


def _group(lines: list[dict[str, Any]]) -> dict[str, Any]:
    per = [phases(ln) for ln in lines]
    out: dict[str, Any] = {"requests": len(lines), "phases_ms": {}}
    for ph in PHASES:
        xs = [1e3 * v for p in per if (v := p[ph]) is not None]
        out["phases_ms"][ph] = {"p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9), "n": len(xs)}
    out["lookup_calls_p50"] = _pct([float(ln.get("lookup_calls") or 0) for ln in lines], 0.5)
    out["prompt_tokens"] = sum(int(ln.get("prompt_tokens") or 0) for ln in lines)
    out["local_hit_tokens"] = sum(int(ln.get("local_hit_tokens") or 0) for ln in lines)
    out["external_tokens"] = sum(int(ln.get("external_tokens") or 0) for ln in lines)
    out["recomputed_tokens"] = sum(recomputed_tokens(ln) for ln in lines)
    # Per-token compute: the compute phase over the tokens computed, summed
    # over the requests that have both (batched neighbours' work included).
    comp_s, comp_tok = 0.0, 0
    for ln, p in zip(lines, per, strict=True):
        if p["compute"] is not None and recomputed_tokens(ln) > 0:
            comp_s += p["compute"]
            comp_tok += recomputed_tokens(ln)
    out["compute_s_per_token"] = comp_s / comp_tok if comp_tok else None
    children: dict[str, dict[str, Any]] = {}
    names: list[str] = []
    for ln in lines:
        for c in ln.get("children") or []:
            if c.get("name") not in names:
                names.append(c.get("name"))
    for name in names:
        rows = [c for ln in lines for c in ln.get("children") or [] if c.get("name") == name]
        nr = [int(c.get("not_ready") or 0) for c in rows]
        waited = [float(c.get("not_ready_s") or 0.0) for c in rows if c.get("not_ready")]
        loads = [
            (c["load_done"] - c["load_start"], int(c.get("load_tokens") or 0))
            for c in rows
            if (c.get("load_tokens") or 0) > 0
            and c.get("load_start") is not None
            and c.get("load_done") is not None
        ]
        load_tok = sum(int(c.get("load_tokens") or 0) for c in rows)
        load_s = sum(s for s, _ in loads)
        timed_tok = sum(t for _, t in loads)
        declined = {r: 0 for r in REASONS}
        for c in rows:
            why = c.get("declined")
            if why is not None:
                declined[why] = declined.get(why, 0) + int(c.get("tokens") or 0)
        per_tok = load_s / timed_tok if timed_tok else None
        cpt = out["compute_s_per_token"]
        children[name] = {
            "requests": len(rows),
            "not_ready": sum(nr),
            "not_ready_p50": _pct([float(x) for x in nr], 0.5),
            "waited_requests": len(waited),
            "not_ready_s_p50": _pct(waited, 0.5),
            "not_ready_s_max": max(waited) if waited else None,
            "loads": len(loads),
            "load_ms_p50": None if not loads else 1e3 * statistics.median(s for s, _ in loads),
            "load_ms_max": None if not loads else 1e3 * max(s for s, _ in loads),
            "load_tokens": load_tok,
            "load_s_per_token": per_tok,
            "recompute_over_load": cpt / per_tok if cpt is not None and per_tok else None,
            "declined_tokens": declined,
        }
    out["children"] = children
    return out


def breakdown(
    lines: Iterable[dict[str, Any]],
    reuse: Callable[[dict[str, Any]], bool] | None = None,
    min_prompt_tokens: int = MIN_PROMPT_TOKENS,
) -> dict[str, Any]:
    """The phases' p50 and p90 and the per-child figures, for all requests
    and for the reuse requests (``reuse(line)``; default: a prefix came from
    vLLM's cache or a child); lines under ``min_prompt_tokens`` prompt
    tokens (warm-up) are dropped."""
    every = list(lines)
    kept = [ln for ln in every if int(ln.get("prompt_tokens") or 0) >= min_prompt_tokens]
    is_reuse = reuse or (
        lambda ln: int(ln.get("local_hit_tokens") or 0) + int(ln.get("external_tokens") or 0) > 0
    )
    return {
        "lines": len(every),
        "dropped_warmup": len(every) - len(kept),
        "all": _group(kept),
        "reuse": _group([ln for ln in kept if is_reuse(ln)]),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def format_breakdown(name: str, b: dict[str, Any]) -> list[str]:
    """Text lines: a phase table (all requests, reuse requests), then per child."""
    a, r = b["all"], b["reuse"]
    lines = [
        f"breakdown {name} (kvmux timeline): {a['requests']} requests, "
        f"{r['requests']} reuse rounds, {b['dropped_warmup']} warm-up dropped",
        f"  {'phase (ms)':14}{'p50':>8}{'p90':>8}{'reuse p50':>11}{'p90':>8}",
    ]
    for ph in PHASES:
        pa, pr = a["phases_ms"][ph], r["phases_ms"][ph]
        lines.append(
            f"  {ph.replace('_', ' '):14}{_ms(pa['p50']):>8}{_ms(pa['p90']):>8}"
            f"{_ms(pr['p50']):>11}{_ms(pr['p90']):>8}"
        )
    lc = a["lookup_calls_p50"]
    cpt = a["compute_s_per_token"]
    lines.append(
        f"  lookup calls p50 {'-' if lc is None else f'{lc:g}'}; tokens: prompt "
        f"{a['prompt_tokens']}, vLLM cache {a['local_hit_tokens']}, children "
        f"{a['external_tokens']}, recomputed {a['recomputed_tokens']}; compute "
        f"{'-' if cpt is None else f'{1e3 * cpt:.2f}'} ms per recomputed token"
    )
    for cname, c in a["children"].items():
        wait = (
            f"not ready {c['not_ready']} (p50 {c['not_ready_p50']:g} per request), waited "
            f"p50 {_ms(None if c['not_ready_s_p50'] is None else 1e3 * c['not_ready_s_p50'])} "
            f"max {_ms(None if c['not_ready_s_max'] is None else 1e3 * c['not_ready_s_max'])} ms"
            if c["not_ready_p50"] is not None
            else "no lookups"
        )
        ratio = c["recompute_over_load"]
        dec = ", ".join(f"{k} {v}" for k, v in c["declined_tokens"].items())
        lines.append(
            f"  {cname}: {wait}; {c['loads']} loads p50 {_ms(c['load_ms_p50'])} "
            f"max {_ms(c['load_ms_max'])} ms, {c['load_tokens']} tokens"
            + ("" if ratio is None else f" (recompute/load per token {ratio:.1f})")
            + f"; declined tokens {dec}"
        )
    return lines
