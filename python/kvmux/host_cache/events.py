"""The host tier's KV cache events: which blocks it holds, in vLLM's types.

With vLLM's KV cache events on (``--kv-events-config
'{"enable_kv_cache_events": true, ...}'``), the tier reports from its
scheduler side (``take_events``, published by vLLM with its own GPU events):

- ``BlockStored`` when a block becomes readable (every worker confirmed its
  copy), one event per run of consecutive blocks of a request and group;
- ``BlockRemoved`` when a readable block leaves: evicted (LRU) to make room
  for a new save, or dropped by ``reset_cache``.

A save that fails or is dropped was never announced, so it is never
removed either. The events carry ``medium="CPU"`` and ``locality="LOCAL"``
(as vLLM's own CPU offloading tier does), and the block identity vLLM's GPU
events carry for the same prefix: ``maybe_convert_block_hash`` of the
request's block hash (without prefix caching, kvmux's chained token hash),
with its parent hash, token ids, LoRA and extra keys, so a router can match
a CPU block with the GPU block of the same tokens (under vLLM 0.34's
lookahead hashes, as vLLM's own events do: extra keys over the block and
its lookahead tokens, and those tokens as ``lookahead_token_ids``). Under
``KvmuxConnector`` each event's ``ownership`` also names the child
(``kvmux.mux.events``).

What happens to the blocks the Rust index reports itself, as events
(``HostIndex.take_events``: stored, aborted, evicted, dropped, each with its
group and block hash); this module formats them for vLLM. A block's event
payload (tokens, parent, LoRA, extra keys) is captured when its save is
reserved (the request is alive then) and kept, by group and block hash,
until the index reports the save stored or aborted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["LOCALITY", "GroupSpec", "HostEvents", "group_specs", "kv_events_enabled"]

#: Where the tier's blocks are, relative to the vLLM instance publishing
#: the events (vLLM's ``SimpleCPUOffloadConnector`` says the same of its own).
LOCALITY = "LOCAL"


@dataclass(frozen=True)
class GroupSpec:
    """What a ``BlockStored`` says of a KV cache group (vLLM's
    ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``)."""

    kind: str | None = None
    sliding_window: int | None = None


@dataclass(frozen=True)
class _Block:
    """A block being saved, with what its ``BlockStored`` will say."""

    req_id: str
    group: int
    index: int
    key: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None
    lookahead: tuple[int, ...] = ()
    """The tokens after the block its hash covers (vLLM 0.34's lookahead)."""


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV cache events (``--kv-events-config`` with
    ``enable_kv_cache_events``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


def group_specs(kv_cache_config: KVCacheConfig) -> list[GroupSpec]:
    """Each KV cache group's kind and sliding window, as vLLM names them."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return [
        GroupSpec(
            get_kv_cache_spec_kind(g.kv_cache_spec).value,
            get_kv_cache_spec_sliding_window(g.kv_cache_spec),
        )
        for g in kv_cache_config.kv_cache_groups
    ]


class HostEvents:
    """Turns the host index's events into vLLM KV cache events."""

    def __init__(
        self, block_size: int, groups: Sequence[GroupSpec], hash_lookahead: int = 0
    ) -> None:
        """``hash_lookahead``: vLLM's ``num_hash_lookahead_tokens``."""
        self.block_size = block_size
        self.hash_lookahead = hash_lookahead
        self.groups = list(groups)
        # (group, block hash) -> the block being saved, until stored or aborted
        self._saving: dict[tuple[int, bytes], _Block] = {}
        self._queue: list[KVCacheEvent] = []

    # ----------------------------------------------------- block changes

    def reserved(
        self, request: Request, keys: Sequence[bytes], group: int, blocks: Sequence[int]
    ) -> None:
        """Saves of ``request``'s ``blocks`` (indices into ``keys``, its
        blocks' identities) of ``group`` were reserved: what their
        ``BlockStored`` will say."""
        bs = self.block_size
        lora = request.lora_request
        lora_id = lora.adapter_id if lora else None
        lora_name = lora.name if lora else None
        tokens = request.all_token_ids
        ahead = self.hash_lookahead
        if ahead:  # vLLM 0.34: what its BlockPool's events say of a block
            from vllm.v1.core.kv_cache_utils import generate_lookahead_block_hash_extra_keys
        for b in blocks:
            start, end = b * bs, (b + 1) * bs
            if ahead:
                extra = generate_lookahead_block_hash_extra_keys(
                    request, start, end, end + ahead, 0
                )[0]
            else:
                extra = generate_block_hash_extra_keys(request, start, end, 0)[0]
            self._saving[group, keys[b]] = _Block(
                request.request_id,
                group,
                b,
                keys[b],
                keys[b - 1] if b > 0 else None,
                tuple(tokens[start:end]),
                lora_id,
                lora_name,
                extra,
                tuple(tokens[end : end + ahead]),
            )

    def apply(self, events: Sequence[tuple[str, int, bytes, str | None]]) -> None:
        """The index's events (``HostIndex.take_events``), in order: blocks
        stored (readable now) are announced, blocks evicted or dropped are
        removed, aborted saves are forgotten (never announced)."""
        runs: dict[tuple[str, int], list[_Block]] = {}
        gone: dict[int, list[bytes]] = {}
        for kind, group, key, _ in events:
            if kind == "stored":
                if gone:
                    self._removed(gone)
                    gone = {}
                b = self._saving.pop((group, key), None)
                if b is not None:
                    runs.setdefault((b.req_id, b.group), []).append(b)
            elif kind == "aborted":
                self._saving.pop((group, key), None)
            else:  # evicted, dropped
                if runs:
                    self._stored(runs)
                    runs = {}
                gone.setdefault(group, []).append(key)
        self._stored(runs)
        self._removed(gone)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in order."""
        out, self._queue = self._queue, []
        return out

    # ----------------------------------------------------------- events

    def _stored(self, runs: dict[tuple[str, int], list[_Block]]) -> None:
        """``BlockStored`` events for the blocks of each request and group,
        one per run of consecutive blocks."""
        for blocks in runs.values():
            blocks.sort(key=lambda b: b.index)
            run = [blocks[0]]
            for b in blocks[1:]:
                if b.index != run[-1].index + 1:
                    self._queue.append(self._stored_run(run))
                    run = []
                run.append(b)
            self._queue.append(self._stored_run(run))

    def _stored_run(self, run: list[_Block]) -> BlockStored:
        """One ``BlockStored`` for consecutive blocks of one request and
        group: their hashes, the parent of the first, all their tokens."""
        first = run[0]
        spec = self.groups[first.group] if first.group < len(self.groups) else GroupSpec()
        # vLLM 0.34's field, set under lookahead hashes only (0.33 has none).
        ahead: dict[str, Any] = (
            {"lookahead_token_ids": [list(b.lookahead) for b in run]} if self.hash_lookahead else {}
        )
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(BlockHash(b.key)) for b in run],
            parent_block_hash=(
                maybe_convert_block_hash(BlockHash(first.parent))
                if first.parent is not None
                else None
            ),
            token_ids=[t for b in run for t in b.token_ids],
            block_size=self.block_size,
            lora_id=first.lora_id,
            medium=MEDIUM_CPU,
            lora_name=first.lora_name,
            extra_keys=to_event_extra_keys([b.extra_keys for b in run]),
            group_idx=first.group,
            kv_cache_spec_kind=spec.kind,
            kv_cache_spec_sliding_window=spec.sliding_window,
            locality=LOCALITY,
            **ahead,
        )

    def _removed(self, by_group: dict[int, list[bytes]]) -> None:
        for g, keys in by_group.items():
            self._queue.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(BlockHash(k)) for k in keys],
                    medium=MEDIUM_CPU,
                    group_idx=g,
                    locality=LOCALITY,
                )
            )
