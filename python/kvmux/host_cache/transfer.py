"""The host tier's data path: torch only (no vLLM), so a GPU check needs
nothing but torch and the kvmux wheel.

A :class:`HostPool` mirrors the paged KV caches vLLM registered: for every
layer a host tensor of ``num_slots`` blocks (pinned memory when the KV cache
is on CUDA). Copies are batched: per step and per layer one gather (save) or
one scatter (load) over all blocks of all requests, plus one contiguous copy
per run of consecutive host slots (the index hands out consecutive slots, so
usually one). On CUDA they run on a side stream: saves start after the
forward and the next step's forward waits for them on the GPU (never on the
CPU); loads are waited for on the GPU before the forward reads them.

KV cache groups (hybrid models): vLLM's groups overlay one another, a layer
of each group sharing one tensor, because a device block belongs to one
group at a time. The host pool mirrors that: layers whose device tensors
are the same view share one host tensor, and a host slot holds one block of
one group. Each copy moves one group's blocks through that group's layers.

Supported per-layer layouts (the axis of size ``num_blocks`` is found):

- blocks first: ``(num_blocks, ...)``, e.g. vLLM 0.33's CPU and standard
  views ``(num_blocks, kv_heads, block_size, 2 * head_size)``;
- K/V first: ``(2, num_blocks, ...)``, e.g. FlashAttention's
  ``(2, num_blocks, block_size, kv_heads, head_size)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

_np: ModuleType | None
try:  # vLLM requires NumPy; the host tier only copies faster with it
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

__all__ = ["HostPool", "Transfer", "UnsupportedKVLayout", "contiguous_runs"]


class UnsupportedKVLayout(ValueError):
    """A registered KV cache tensor whose layout the host tier cannot copy."""


def contiguous_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split ``slots`` into maximal runs of consecutive values:
    ``(position in slots, first slot, length)``."""
    runs: list[tuple[int, int, int]] = []
    for pos, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            p, first, n = runs[-1]
            runs[-1] = (p, first, n + 1)
        else:
            runs.append((pos, s, 1))
    return runs


def _byte_rows(t: torch.Tensor) -> Any | None:
    """``t`` as a NumPy ``(t.shape[0], row bytes)`` uint8 array over the same
    memory, or None where that view does not exist (not a contiguous CPU
    tensor, or no NumPy)."""
    if _np is None or t.device.type != "cpu" or not t.is_contiguous() or t.dim() < 2:
        return None
    return t.view(torch.uint8).view(t.shape[0], -1).numpy()


@dataclass
class _Layer:
    name: str
    device: torch.Tensor
    host: torch.Tensor
    block_dim: int  # 0: blocks first; 1: K/V first

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """The blocks ``idx`` as a contiguous ``(n, *block_shape)`` tensor."""
        got = self.device.index_select(self.block_dim, idx)
        return got if self.block_dim == 0 else got.transpose(0, 1).contiguous()

    def scatter(self, idx: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` (``(n, *block_shape)``) into the blocks ``idx``."""
        if self.block_dim == 0:
            dst_rows, src_rows = _byte_rows(self.device), _byte_rows(src)
            if dst_rows is not None and src_rows is not None:
                # NumPy's row assignment copies each block as one run of
                # bytes; torch's index_copy_ on the CPU was measured 1.3-2x
                # slower on 32 KiB blocks (benches/RESULTS.md, P4).
                dst_rows[idx.numpy()] = src_rows
            else:
                self.device.index_copy_(0, idx, src)
        else:
            self.device.index_copy_(1, idx, src.transpose(0, 1))


@dataclass
class Transfer:
    """One step's batched copy in one direction. ``done()`` polls its event
    (always True on the CPU, where copies are synchronous)."""

    nbytes: int
    event: torch.cuda.Event | None = None
    keep: list[torch.Tensor] = field(default_factory=list)

    def done(self) -> bool:
        if self.event is None or self.event.query():
            self.keep.clear()
            return True
        return False

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.keep.clear()


def _block_dim(t: torch.Tensor, num_blocks: int) -> int | None:
    if t.dim() >= 2 and t.shape[0] == num_blocks:
        return 0
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return 1
    return None


class HostPool:
    """Host copies of ``num_slots`` KV blocks of the layers of ``kv_caches``.

    ``groups``: the layer names of each KV cache group (vLLM's
    ``KVCacheConfig.kv_cache_groups``); None is one group of every layer.
    A slot holds one block of one group; :meth:`save` and :meth:`load` copy
    one group's blocks.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        num_slots: int,
        *,
        groups: Sequence[Sequence[str]] | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors were registered")
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        first = next(iter(kv_caches.values()))
        self.device = first.device
        self.is_cuda = self.device.type == "cuda"
        self._pin = self.is_cuda if pin_memory is None else pin_memory
        self.num_slots = num_slots
        self._num_blocks = num_blocks
        # One host tensor per distinct device view, shared by the groups
        # whose layers overlay it.
        self._hosts: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        self.groups: list[list[_Layer]] = []
        for g, names in enumerate([list(kv_caches)] if groups is None else groups):
            missing = [n for n in names if n not in kv_caches]
            if missing:
                raise UnsupportedKVLayout(
                    f"KV cache group {g}'s layers {missing} were not registered; the host "
                    "tier copies the layers of vLLM's KV cache config"
                )
            self.groups.append(self._group_layers({n: kv_caches[n] for n in names}))
        # Host bytes of one slot (a row of every host tensor), and the bytes
        # one block of each group moves.
        self.block_bytes = sum(
            host[0].numel() * host.element_size() for host in self._hosts.values()
        )
        self.group_block_bytes = [
            sum(layer.host[0].numel() * layer.host.element_size() for layer in layers)
            for layers in self.groups
        ]
        self._stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None
        self._last_save: torch.cuda.Event | None = None

    @property
    def layers(self) -> list[_Layer]:
        """Every copied layer of every group."""
        return [layer for layers in self.groups for layer in layers]

    def _group_layers(self, kv_caches: Mapping[str, torch.Tensor]) -> list[_Layer]:
        num_blocks = self._num_blocks
        layers: list[_Layer] = []
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        for name, t in kv_caches.items():
            if not isinstance(t, torch.Tensor):
                raise UnsupportedKVLayout(
                    f"layer {name!r}: KV cache is a {type(t).__name__}, not a tensor "
                    "(per-layer lists of tensors are not supported by the host tier)"
                )
            if t.device != self.device:
                raise UnsupportedKVLayout(
                    f"layer {name!r} is on {t.device} but others are on {self.device}"
                )
            dim = _block_dim(t, num_blocks)
            if dim is None:
                raise UnsupportedKVLayout(
                    f"layer {name!r} has KV cache shape {tuple(t.shape)}; the host tier "
                    f"supports blocks-first ({num_blocks}, ...) and K/V-first "
                    f"(2, {num_blocks}, ...) layouts. Use an attention backend with one "
                    "of these layouts or remove KvmuxHostCache from the connectors."
                )
            alias = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if alias in seen:  # layers sharing one KV cache are copied once
                continue
            seen.add(alias)
            host = self._hosts.get(alias)
            if host is None:
                block_shape = t.shape[1:] if dim == 0 else (2, *t.shape[2:])
                host = torch.empty(
                    (self.num_slots, *block_shape), dtype=t.dtype, pin_memory=self._pin
                )
                self._hosts[alias] = host
            layers.append(_Layer(name, t, host, dim))
        return layers

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.num_slots

    def _idx(self, values: Sequence[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.long)
        return t.to(self.device, non_blocking=True) if self.is_cuda else t

    def fence(self) -> None:
        """Make the current CUDA stream wait (on the GPU) for the last save,
        so a forward cannot overwrite blocks a save still reads. Call once per
        step before the forward."""
        if self._last_save is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_save)
            self._last_save = None

    def _runs(self, blocks: Sequence[int], slots: Sequence[int]) -> list[tuple[int, int, int]]:
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} blocks but {len(slots)} slots")
        return contiguous_runs(slots)

    def _group(self, group: int) -> list[_Layer]:
        if not 0 <= group < len(self.groups):
            raise ValueError(f"KV cache group {group} out of range: {len(self.groups)} group(s)")
        return self.groups[group]

    def save(self, blocks: Sequence[int], slots: Sequence[int], group: int = 0) -> Transfer:
        """Copy ``group``'s device ``blocks`` into host ``slots`` (device -> host)."""
        layers = self._group(group)
        runs = self._runs(blocks, slots)
        if not runs:
            return Transfer(0)
        nbytes = self.group_block_bytes[group] * len(blocks)
        stream = self._stream
        if stream is None:  # not CUDA
            idx = self._idx(blocks)
            for layer in layers:
                if layer.block_dim == 0 and len(runs) == 1:
                    # One pass: gather straight into the host slots.
                    _, first, n = runs[0]
                    torch.index_select(layer.device, 0, idx, out=layer.host[first : first + n])
                else:
                    self._to_host_runs(layer, layer.gather(idx), runs)
            return Transfer(nbytes)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        keep: list[torch.Tensor] = []
        with torch.cuda.stream(stream):
            idx = self._idx(blocks)
            for layer in layers:
                gathered = layer.gather(idx)
                self._to_host_runs(layer, gathered, runs, non_blocking=True)
                keep.append(gathered)
            event = torch.cuda.Event()
            event.record(stream)
        self._last_save = event
        return Transfer(nbytes, event, keep)

    @staticmethod
    def _to_host_runs(
        layer: _Layer,
        gathered: torch.Tensor,
        runs: list[tuple[int, int, int]],
        non_blocking: bool = False,
    ) -> None:
        for pos, first, n in runs:
            layer.host[first : first + n].copy_(gathered[pos : pos + n], non_blocking=non_blocking)

    def load(self, slots: Sequence[int], blocks: Sequence[int], group: int = 0) -> Transfer:
        """Copy host ``slots`` into ``group``'s device ``blocks`` (host ->
        device). On CUDA the current stream waits for the copy on the GPU."""
        layers = self._group(group)
        runs = self._runs(blocks, slots)
        if not runs:
            return Transfer(0)
        nbytes = self.group_block_bytes[group] * len(blocks)
        stream = self._stream
        if stream is None:  # not CUDA
            idx = self._idx(blocks)
            sidx = None if len(runs) == 1 else torch.tensor(slots, dtype=torch.long)
            for layer in layers:
                if sidx is None:
                    _, first, n = runs[0]
                    src = layer.host[first : first + n]  # a view: one pass
                else:
                    src = layer.host.index_select(0, sidx)
                layer.scatter(idx, src)
            return Transfer(nbytes)
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        keep: list[torch.Tensor] = []
        with torch.cuda.stream(stream):
            idx = self._idx(blocks)
            for layer in layers:
                staging = torch.empty(
                    (len(blocks), *layer.host.shape[1:]),
                    dtype=layer.host.dtype,
                    device=self.device,
                )
                for pos, first, n in runs:
                    staging[pos : pos + n].copy_(layer.host[first : first + n], non_blocking=True)
                layer.scatter(idx, staging)
                keep.append(staging)
            event = torch.cuda.Event()
            event.record(stream)
        current.wait_event(event)
        return Transfer(nbytes, event, keep)
