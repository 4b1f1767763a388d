"""kvmux.bench.timeline over synthetic timeline lines (the format of
``timeline_path``): phase arithmetic, medians and p90, null handling (a
request that never got ready, a declined child without a span), the
warm-up dropped, the per-child figures, reading a file with a cut line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvmux.bench import timeline


def child(name: str, **kw: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": name,
        "not_ready": 0,
        "not_ready_s": 0.0,
        "tokens": 0,
        "declined": None,
        "load_tokens": 0,
        "load_async": False,
        "load_start": None,
        "load_done": None,
    }
    c.update(kw)
    return c


def line(**kw: Any) -> dict[str, Any]:
    ln: dict[str, Any] = {
        "req_id": "x",
        "arrival": 0.0,
        "prompt_tokens": 512,
        "first_lookup": 0.0,
        "lookup_calls": 1,
        "ready": 0.0,
        "local_hit_tokens": 0,
        "children": [child("H"), child("L")],
        "allocated": 0.0,
        "external_tokens": 0,
        "first_token": 0.0,
        "finished": 0.0,
    }
    ln.update(kw)
    return ln


WARMUP = line(req_id="w", prompt_tokens=32, arrival=0.0, first_lookup=9.0, first_token=99.0)
# Cold: nothing from anywhere. queue 100, wait 0, admit 50, no load, compute 1000, total 1150.
COLD = line(
    req_id="b",
    arrival=100.0,
    first_lookup=100.1,
    ready=100.1,
    allocated=100.15,
    first_token=101.15,
)
# L loads 384 tokens after two not-ready answers (0.3 s); vLLM's cache 64.
# queue 200, wait 300, admit 100, load 100, compute 100, total 800.
ASYNC = line(
    req_id="c",
    arrival=200.0,
    first_lookup=200.2,
    lookup_calls=3,
    ready=200.5,
    local_hit_tokens=64,
    children=[
        child("H"),
        child(
            "L",
            not_ready=2,
            not_ready_s=0.3,
            tokens=384,
            load_tokens=384,
            load_async=True,
            load_start=200.6,
            load_done=200.7,
        ),
    ],
    allocated=200.6,
    external_tokens=384,
    first_token=200.8,
)
# Never ready (aborted): L declined for its wait, its span unknown (null).
NEVER = line(
    req_id="d",
    arrival=300.0,
    first_lookup=300.05,
    lookup_calls=5,
    ready=None,
    children=[
        child("H"),
        child("L", not_ready=5, not_ready_s=0.4, tokens=None, declined="slow_wait"),
    ],
    allocated=None,
    first_token=None,
)
# H loads 128 tokens in 20 ms; L's 256 tokens declined as slower than computing.
# queue 0, wait 0, admit 10, load 20, compute 380, total 410.
DECLINED = line(
    req_id="e",
    arrival=400.0,
    first_lookup=400.0,
    ready=400.0,
    prompt_tokens=544,
    children=[
        child("H", tokens=128, load_tokens=128, load_start=400.01, load_done=400.03),
        child("L", tokens=256, declined="slow_load"),
    ],
    allocated=400.01,
    external_tokens=128,
    first_token=400.41,
)
LINES = [WARMUP, COLD, ASYNC, NEVER, DECLINED]


def approx(x: float) -> Any:
    return pytest.approx(x, rel=1e-6, abs=1e-6)


def test_phases_of_one_request():
    p = timeline.phases(ASYNC)
    assert p == {
        "queue": approx(0.2),
        "lookup_wait": approx(0.3),
        "admit": approx(0.1),
        "load": approx(0.1),
        "compute": approx(0.1),
        "total": approx(0.8),
    }
    # Nothing loaded: compute starts at the allocation.
    assert timeline.phases(COLD)["load"] is None
    assert timeline.phases(COLD)["compute"] == approx(1.0)
    # Never ready: the phases after the lookup are unknown, not zero.
    p = timeline.phases(NEVER)
    assert p["queue"] == approx(0.05)
    assert p["lookup_wait"] is p["admit"] is p["load"] is p["compute"] is p["total"] is None


def test_breakdown_all_requests():
    b = timeline.breakdown(LINES)
    assert b["lines"] == 5 and b["dropped_warmup"] == 1
    a = b["all"]
    assert a["requests"] == 4
    ph = a["phases_ms"]
    assert ph["queue"]["p50"] == approx(75.0)  # 0, 50, 100, 200
    assert ph["queue"]["n"] == 4
    assert ph["lookup_wait"]["p50"] == approx(0.0) and ph["lookup_wait"]["n"] == 3
    assert ph["admit"]["p50"] == approx(50.0)
    assert ph["load"]["p50"] == approx(60.0) and ph["load"]["n"] == 2
    assert ph["compute"]["p50"] == approx(380.0)
    assert ph["total"]["p50"] == approx(800.0)
    assert ph["total"]["p90"] == approx(1080.0)  # 800 + 0.8 * (1150 - 800)
    assert a["lookup_calls_p50"] == approx(2.0)  # 1, 1, 3, 5
    assert a["prompt_tokens"] == 512 * 3 + 544
    assert a["local_hit_tokens"] == 64 and a["external_tokens"] == 512
    assert a["recomputed_tokens"] == 512 + 64 + 512 + 416
    # Compute seconds over computed tokens, of the requests with both.
    assert a["compute_s_per_token"] == approx((1.0 + 0.1 + 0.38) / (512 + 64 + 416))

    h, lm = a["children"]["H"], a["children"]["L"]
    assert list(a["children"]) == ["H", "L"]
    assert lm["not_ready"] == 7 and lm["not_ready_p50"] == approx(1.0)  # 0, 0, 2, 5
    assert lm["waited_requests"] == 2
    assert lm["not_ready_s_p50"] == approx(0.35) and lm["not_ready_s_max"] == approx(0.4)
    assert lm["loads"] == 1 and lm["load_ms_p50"] == approx(100.0) and lm["load_tokens"] == 384
    # The declined span with a null token count adds nothing.
    assert lm["declined_tokens"] == {"slow_load": 256, "slow_wait": 0}
    assert h["not_ready"] == 0 and h["not_ready_s_p50"] is None and h["not_ready_s_max"] is None
    assert h["loads"] == 1 and h["load_ms_max"] == approx(20.0) and h["load_tokens"] == 128
    assert h["declined_tokens"] == {"slow_load": 0, "slow_wait": 0}
    assert h["load_s_per_token"] == approx(0.02 / 128)
    assert h["recompute_over_load"] == approx(a["compute_s_per_token"] / (0.02 / 128))


def test_breakdown_reuse_split():
    # Default: a prefix came from vLLM's cache or a child.
    r = timeline.breakdown(LINES)["reuse"]
    assert r["requests"] == 2  # ASYNC, DECLINED
    assert r["phases_ms"]["queue"]["p50"] == approx(100.0)
    assert r["phases_ms"]["total"]["p50"] == approx(605.0)
    assert r["phases_ms"]["load"]["p50"] == approx(60.0)
    # Given: by prompt length (the benches map lengths to rounds).
    r = timeline.breakdown(LINES, reuse=lambda ln: ln["prompt_tokens"] == 544)["reuse"]
    assert r["requests"] == 1 and r["phases_ms"]["compute"]["p50"] == approx(380.0)
    assert r["children"]["L"]["declined_tokens"]["slow_load"] == 256


def test_breakdown_of_nothing():
    b = timeline.breakdown([WARMUP])
    assert b["dropped_warmup"] == 1 and b["all"]["requests"] == 0
    assert b["all"]["phases_ms"]["total"] == {"p50": None, "p90": None, "n": 0}
    assert b["all"]["compute_s_per_token"] is None and b["all"]["children"] == {}
    out = timeline.format_breakdown("empty", b)
    assert out[0].startswith("breakdown empty") and "-" in out[-1]


def test_format_breakdown_lines():
    out = timeline.format_breakdown("shared-l2-cost", timeline.breakdown(LINES))
    assert out[0] == (
        "breakdown shared-l2-cost (kvmux timeline): 4 requests, 2 reuse rounds, 1 warm-up dropped"
    )
    rows = {ln.split()[0]: ln for ln in out[2:8]}
    assert rows["total"].split()[1:] == ["800", "1080", "605", "761"]
    assert rows["lookup"].split()[2:] == ["0", "240", "150", "270"]  # lookup wait
    text = "\n".join(out)
    assert "L: not ready 7 (p50 1 per request), waited p50 350 max 400 ms" in text
    assert "declined tokens slow_load 256, slow_wait 0" in text
    assert "H: not ready 0" in text and "1 loads p50 20 max 20 ms, 128 tokens" in text


def test_load_skips_cut_and_blank_lines(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(COLD) + "\n\n" + json.dumps(ASYNC) + '\n{"req_id": "cut', "utf-8")
    assert timeline.load(path) == [COLD, ASYNC]
    assert timeline.load(tmp_path / "missing.jsonl") == []
