"""Shared fixtures: vLLM's real scheduler driving kvmux, with the worker side
run in the same process and the metadata pickled between them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import harness  # noqa: E402


@pytest.fixture
def driver_factory():
    return harness.SchedulerSim


@pytest.fixture
def h():
    return harness
