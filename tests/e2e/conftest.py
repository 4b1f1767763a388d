"""Fixtures of the end-to-end suite (see engine_runs.py): the runs are made
once per session and shared by the tests, which assert on what a user sees
in ``RequestOutput``."""

from __future__ import annotations

import pytest

from kvmux.cli import engine
from tests.e2e.engine_runs import ASK, TAGGER, WORKLOAD, Runs, two_passes


@pytest.fixture(scope="session")
def model_dir() -> str:
    from kvmux.bench.tiny_model import tiny_llama

    return str(tiny_llama())


@pytest.fixture(scope="session")
def runs(model_dir: str) -> Runs:
    engine.prepare_env(multiprocess=False)
    base1, base2, _ = two_passes(model_dir, None, None)
    mux1, mux2, mux3 = two_passes(model_dir, engine.host_tier_config(TAGGER), ASK)
    return Runs(WORKLOAD.prompts(), base1, base2, mux1, mux2, mux3)
