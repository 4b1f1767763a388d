"""kvmux: run several vLLM KV connectors as one, with a Rust core.

Load it from vLLM with ``kv_transfer_config``::

    {"kv_connector": "KvmuxConnector", "kv_connector_module_path": "kvmux",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"connectors": [ {...}, {...} ]}}

The error classes import without vLLM; the connector classes need vLLM (the
host that loads kvmux) and are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmux.errors import KvmuxChildError, KvmuxConfigError, KvmuxParamClash

if TYPE_CHECKING:
    from kvmux.host_cache.connector import KvmuxHostCache
    from kvmux.mux.connector import KvmuxConnector

    MultiConnector = KvmuxConnector

__version__ = "0.1.0"

__all__ = [
    "KvmuxChildError",
    "KvmuxConfigError",
    "KvmuxConnector",
    "KvmuxHostCache",
    "KvmuxParamClash",
    "MultiConnector",
]

_LAZY = {
    "KvmuxConnector": ("kvmux.mux.connector", "KvmuxConnector"),
    "KvmuxHostCache": ("kvmux.host_cache.connector", "KvmuxHostCache"),
    # The same class under the name vLLM special-cases for child-aware HMA
    # detection: {"kv_connector": "MultiConnector", "kv_connector_module_path": "kvmux"}.
    "MultiConnector": ("kvmux.mux.connector", "KvmuxConnector"),
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'kvmux' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
