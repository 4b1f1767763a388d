"""vLLM's ``ExampleConnector`` under kvmux keeps one folder per model
(``kvmux.mux.example_storage``): its files are named by the prompt's tokens
alone, so without that a second model on the same ``shared_storage_path``
(the README's "no-service" block copied for another model) would be handed
KV the first one computed. Through vLLM's real scheduler and the real
``ExampleConnector`` writing real files (``tests/support/harness.py``); the
two models have the same shape and differ only in name, the case where
nothing else would catch it."""

from __future__ import annotations

import json
from pathlib import Path

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from kvmux.mux.example_storage import (
    DEFAULT_PATH,
    MARKER,
    model_folder,
    model_identity,
    per_model_transfer_config,
)
from tests.support.harness import BLOCK_SIZE, SchedulerSim, child, mux_config, vllm_config

PREFIX = list(range(100, 164))  # 4 full blocks
PROMPT = PREFIX + [1, 2, 3]  # ExampleConnector stores and finds the prompt's full blocks
ASK = {"num_extra_cached_tokens": True}


def _sim(storage: Path, model_root: Path) -> SchedulerSim:
    files = child("ExampleConnector", shared_storage_path=str(storage))
    return SchedulerSim(mux_config([files]), model_dir=model_root)


def _served(storage: Path, model_root: Path) -> int:
    """A fresh engine of the model under ``model_root`` asks for PROMPT: the
    tokens kvmux's ExampleConnector child supplied."""
    d = _sim(storage, model_root)
    try:
        d.add("B", PROMPT, kv_transfer_params=ASK, max_tokens=2)
        d.run()
        return int(d.finished["B"]["num_extra_cached_tokens"])
    finally:
        d.close()


def test_a_second_model_on_the_same_path_is_never_served_the_first_ones_blocks(tmp_path):
    storage, model_a, model_b = tmp_path / "example", tmp_path / "a", tmp_path / "b"
    d = _sim(storage, model_a)
    try:
        d.add("A", PROMPT, max_tokens=2)
        d.run()
        a_cfg = d.vllm_config
    finally:
        d.close()
    folder_a = Path(model_folder(str(storage), model_identity(a_cfg)))
    stored = list(folder_a.glob("*/*.safetensors"))
    assert len(stored) == 2, list(storage.rglob("*"))  # one file per layer, in A's folder
    assert json.loads((folder_a / MARKER).read_text())["model"] == a_cfg.model_config.model

    # The same model, a new server: served from the files (the path is shared on purpose).
    assert _served(storage, model_a) == len(PREFIX)
    # Another model of the same shape on the same path: computes everything.
    assert _served(storage, model_b) == 0

    # Why it matters: vLLM's ExampleConnector itself, for model B, on the
    # folder A wrote, finds A's KV for the same tokens (its key has no model).
    b_cfg = vllm_config(
        KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(folder_a)},
        ),
        model_dir=model_b,
    )
    assert b_cfg.model_config.model != a_cfg.model_config.model
    bare = ExampleConnector(b_cfg, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
    assert bare._found_match_for_prompt(PROMPT, [])
    assert BLOCK_SIZE * 4 == len(PREFIX)


def test_only_example_connector_children_get_a_folder_per_model(tmp_path):
    cfg = vllm_config(None, model_dir=tmp_path / "a")
    files = KVTransferConfig(**child("ExampleConnector", shared_storage_path="/srv/kv"))
    got = per_model_transfer_config(ExampleConnector, files, cfg)
    want = model_folder("/srv/kv", model_identity(cfg))
    assert got.kv_connector_extra_config["shared_storage_path"] == want
    assert want.startswith("/srv/kv/kvmux-tiny-llama-config-b")
    assert files.kv_connector_extra_config["shared_storage_path"] == "/srv/kv"  # a copy
    # ExampleConnector's own default path, when none is given.
    bare = KVTransferConfig(**child("ExampleConnector"))
    got = per_model_transfer_config(ExampleConnector, bare, cfg)
    assert got.kv_connector_extra_config["shared_storage_path"].startswith(DEFAULT_PATH + "/kvmux-")
    other = KVTransferConfig(**child("KvmuxHostCache", capacity_gib=1))
    from kvmux import KvmuxHostCache

    assert per_model_transfer_config(KvmuxHostCache, other, cfg) is other


def test_the_folder_depends_on_what_decides_the_kv_bytes():
    base = {
        "model": "org/m",
        "revision": None,
        "dtype": "torch.bfloat16",
        "kv_cache_dtype": "auto",
        "tensor_parallel_size": 1,
    }
    folders = {model_folder("/p", base)}
    for key, value in [
        ("model", "org/m2"),
        ("revision", "v2"),
        ("dtype", "torch.float32"),
        ("kv_cache_dtype", "fp8"),
        ("tensor_parallel_size", 2),
    ]:
        folders.add(model_folder("/p", {**base, key: value}))
    assert len(folders) == 6
    assert model_folder("/p", dict(base)) == model_folder("/p", base)
