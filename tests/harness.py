"""Test helpers over :mod:`kvmux.sim` (vLLM's real scheduler in one process):
child configs, including the scripted children of ``tests/scripted.py``."""

from __future__ import annotations

from typing import Any

from vllm.config import KVTransferConfig

from kvmux.sim import *  # noqa: F403
from kvmux.sim import (  # noqa: F401
    BLOCK_SIZE,
    HEAD_SIZE,
    KV_HEADS,
    NUM_BLOCKS,
    NUM_LAYERS,
    SchedulerSim,
    fake_model_output,
    kv_cache_config,
    layer_names,
    make_kv_caches,
    make_request,
    make_scheduler,
    vllm_config,
)


def child(name: str, **extra: Any) -> dict[str, Any]:
    """A child kv_transfer_config dict."""
    d: dict[str, Any] = {"kv_connector": name, "kv_role": "kv_both"}
    module = extra.pop("module", "kvmux" if name.startswith("Kvmux") else None)
    if module:
        d["kv_connector_module_path"] = module
    if extra:
        d["kv_connector_extra_config"] = extra
    return d


def scripted(**extra: Any) -> dict[str, Any]:
    """A child from tests/scripted.py (a connector whose answers a test sets)."""
    d = {
        "kv_connector": "ScriptedConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "scripted",
    }
    d["kv_connector_extra_config"] = extra
    return d


def mux_config(
    children: list[dict[str, Any]], name: str = "KvmuxConnector", **extra: Any
) -> KVTransferConfig:
    """kvmux over ``children`` (``name`` "MultiConnector" is kvmux's alias)."""
    return KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children, **extra},
    )


def upstream_config(children: list[dict[str, Any]]) -> KVTransferConfig:
    """vLLM's own in-tree MultiConnector over the same children."""
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children},
    )
