"""kvmux's built-in host-memory KV tier.

:class:`KvmuxHostCache` (the vLLM connector) needs vLLM; the copy path
:class:`HostPool` needs only torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HostPool", "KvmuxHostCache"]


def __getattr__(name: str) -> Any:
    if name == "HostPool":
        from kvmux.host_cache.transfer import HostPool

        return HostPool
    if name == "KvmuxHostCache":
        from kvmux.host_cache.connector import KvmuxHostCache

        return KvmuxHostCache
    raise AttributeError(f"module 'kvmux.host_cache' has no attribute {name!r}")
