"""The host tier's scheduler side: what is cached (the Rust block index), what
each request loads, and which full blocks each step saves.

Protocol with the workers (all through vLLM's metadata paths):

- a lookup answers the longest prefix every group can serve (one Rust
  call) and pins the slots it offers, so they cannot be evicted before the
  allocation; a new lookup or the request's end releases them;
- the allocation takes the offered slots for the blocks vLLM allocated,
  releases the rest and queues a :class:`LoadJob` per group; the slots are
  unpinned once every worker confirmed the copy;
- each step, the newly full blocks of every scheduled request get reserved
  slots (``Writing``: never readable, never evicted) in a :class:`SaveJob`;
  the slots become readable when every worker confirmed the copy, and are
  freed if one failed;
- the index keeps each slot's whole state (key, group, owner, pins, the
  workers' confirmations still due) and reports what it stores, evicts and
  drops as events: this side turns them into the tier's counters and, with
  vLLM's KV cache events on, into vLLM's events (``events.py``);
- a request finishing while its saves are unconfirmed returns
  ``async_save=True``; the workers report it finished sending once its
  copies are done, and vLLM keeps its blocks until then.

Partial blocks are never stored. Block identities are vLLM's block hashes
(prefix-cache identity: salt, LoRA, multimodal inputs); without them (prefix
caching off, on an engine that hashes nothing) a chained hash of the token
ids, computed in Rust.

vLLM 0.34's lookahead hashes (``num_hash_lookahead_tokens`` L > 0, with a
drafter, when the connector says it supports them): each block's hash also
covers the L tokens after it, which the drafter's KV at the block's last
position reads, and exists only once they do, so ``request.block_hashes``
lags the full blocks. The tier keys by those hashes as they are: a block is
saved once its hash exists and found only by a request whose block and
lookahead tokens are equal, so a hit is never wrong. Its blocks without a
hash yet have no identity: they are neither saved nor looked up (the
token-hash fallback, which covers neither the lookahead tokens nor LoRA
and multimodal inputs, is never used then: vLLM always hashes with a
connector configured, so an empty list only means "not yet").

Hybrid models (several KV cache groups, :mod:`kvmux.host_cache.layout`):
each group's blocks are keyed in the group's own key space of one index. A
lookup answers the longest prefix every group can resume from (one Rust
call). Full-attention groups store every full block; a sliding-window group
stores only the windows before the points a later request can resume at:

- the request's prompt (an identical prompt resumes at its last full block
  before the final token): the window before it and every block after it,
  the generated ones included, since any of them can end a later turn's
  shared prefix;
- the prefix it shared on arrival: vLLM's own prefix-cache hit, and the
  full-attention prefix the tier held beyond what it could serve (so the
  next request sharing it resumes there).

Its other blocks are never read by vLLM for a request that resumes at one
of those points: they are counted as skipped. A load fills, in every group,
the blocks vLLM allocated for the external tokens (a windowed group's
leading blocks are vLLM's null block: nothing to load).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvmux._core import HostIndex, chain_token_hashes
from kvmux.errors import KvmuxConfigError
from kvmux.host_cache.events import HostEvents
from kvmux.host_cache.metadata import (
    HostCacheMetadata,
    HostCacheWorkerMetadata,
    LoadJob,
    SaveJob,
)
from kvmux.host_cache.stats import HostCacheStats

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["STATS_KEY", "HostCacheScheduler"]

#: Ask for it in a request's ``kv_transfer_params`` to get the tier's
#: per-request numbers back in the finished request's params.
STATS_KEY = "host_cache_stats"


class HostCacheScheduler:
    def __init__(
        self,
        block_size: int,
        num_slots: int,
        num_workers: int,
        windows: Sequence[int | None] = (None,),
        kinds: Sequence[str] | None = None,
        events: HostEvents | None = None,
        promote: bool = True,
        slot_bytes: int = 0,
        hash_lookahead: int = 0,
        eviction: str = "slru",
        tenant_max_share: float = 1.0,
    ) -> None:
        """``windows``: per KV cache group, None for full attention, else the
        blocks the group reads before a resume point; ``kinds``: the groups'
        kinds, for the stats (see ``layout.py``); ``events``: the tier's KV
        cache events, when vLLM's are on (``events.py``); ``promote``: save
        the blocks other children loaded too; ``slot_bytes``: the host
        memory of one slot, for the tier's gauges; ``hash_lookahead``:
        vLLM's ``num_hash_lookahead_tokens`` (> 0: block hashes cover the
        tokens after each block, and the token-hash fallback is off);
        ``eviction`` and ``tenant_max_share``: the index's policy (see
        ``config.py``; a tenant is a request's ``cache_salt``)."""
        self.block_size = block_size
        self.hash_lookahead = hash_lookahead
        self.windows = list(windows)
        self.kinds = (
            list(kinds)
            if kinds is not None
            else ["full_attention" if w is None else "sliding_window" for w in self.windows]
        )
        try:
            self.index = HostIndex(
                num_slots,
                len(self.windows),
                num_workers,
                block_size=block_size,
                windows=self.windows,
                promote=promote,
                eviction=eviction,
                tenant_max_share=tenant_max_share,
            )
        except MemoryError as e:
            raise KvmuxConfigError(
                f"KvmuxHostCache: the index of {num_slots} blocks cannot be allocated ({e}); "
                "lower capacity_gib or num_blocks"
            ) from e
        self._multi = len(self.windows) > 1
        # Per-group stats for any layout but the plain one (one full group).
        self._per_group = self._multi or self.windows[0] is not None
        # The vLLM requests the tier holds state for (their state: the
        # index's per-request table, ``rust/host_tier/requests.rs``).
        self._reqs: dict[str, Request] = {}
        self._finished_async: list[str] = []
        self.stats = HostCacheStats()
        self.slot_bytes = slot_bytes
        self._usage: tuple[int, int, int, list[int]] | None = None  # last reported
        self._policy_usage: tuple[int, int, int, int, int] | None = None  # last reported
        self.events = events
        self.promote = promote

    # -------------------------------------------------------------- keys

    def keys(self, request: Request, start: int = 0, end: int | None = None) -> list[bytes]:
        """The identities of the request's full blocks ``[start, end)``:
        vLLM's block hashes (sliced, not copied whole, when a range is
        asked), else (no lookahead hashes) the chained token hash computed
        in Rust. Under lookahead hashes, only the blocks vLLM hashed."""
        hashes: Sequence[bytes] = request.block_hashes
        if not hashes and not self.hash_lookahead:
            salt = (getattr(request, "cache_salt", None) or "").encode("utf-8", "surrogatepass")
            hashes = chain_token_hashes(list(request.all_token_ids), self.block_size, salt)
        if start == 0 and end is None and isinstance(hashes, list):
            return hashes  # read-only use: the core borrows, never mutates
        return list(hashes[start:end])

    def num_keys(self, request: Request) -> int:
        """How many full blocks have an identity (no hashing, no copy)."""
        if self.hash_lookahead:
            return len(request.block_hashes)
        return len(request.block_hashes) or len(request.all_token_ids) // self.block_size

    # ------------------------------------------------------------ events

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The longest prefix every group can serve beyond vLLM's local hit.
        The slots it offers are pinned until the allocation takes them (or a
        new lookup, or the request's end, releases them): what the tier
        offers, it can load (one Rust call, ``HostTier::lookup``)."""
        self._reqs[request.request_id] = request
        external = self.index.lookup(
            request.request_id,
            self.keys(request),
            num_computed_tokens,
            request.num_tokens,
            request.num_prompt_tokens,
        )
        self.stats.add("lookups", 1)
        self.stats.add("lookup_hit_tokens", external)
        return external, False

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        """vLLM allocated the request's blocks, ``num_external_tokens`` of
        them for the tier to fill. In every group, each such block vLLM
        allocated (a windowed group's are its window; the rest are vLLM's
        null block) gets the offered slot, and the loads are queued; offered
        slots left over are released (one Rust call, ``HostTier::allocated``).
        Blocks not in the tier are load errors with one KV cache group (vLLM
        recomputes them); with several, vLLM cannot map block-level errors
        back to requests, and loading part of a prefix would corrupt it:
        refused (the lookup pins what it offers, so this takes vLLM
        allocating what the lookup did not answer)."""
        req_id = request.request_id
        self._reqs.setdefault(req_id, request)
        if num_external_tokens <= 0:
            self.index.allocated(req_id, [], [], 0)
            return
        got = self.index.allocated(
            req_id, self.keys(request), blocks.get_block_ids(), num_external_tokens
        )
        if got is None:
            raise RuntimeError(
                f"KvmuxHostCache: vLLM allocated blocks for request {req_id!r} "
                "that the host tier's lookup did not offer, in a model of "
                f"{len(self.windows)} KV cache groups, where vLLM cannot recompute failed "
                "blocks; this is a bug in kvmux or an unsupported vLLM version: please report it"
            )
        loaded, group_blocks, load_errors = got
        if load_errors:
            self.stats.add("load_errors", load_errors)
            return
        self.stats.add("loaded_tokens", loaded)
        if self._per_group:
            for g, n in enumerate(group_blocks):
                if n:
                    self.stats.add(f"group{g}.loaded_blocks", n)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, kv_cache_manager: Any
    ) -> HostCacheMetadata:
        loads = [
            LoadJob(req_id, tuple(slots), tuple(blocks), group, failed=failed)
            for req_id, slots, blocks, group, failed in self.index.take_loads()
        ]
        meta = HostCacheMetadata(loads=loads, finished_async=self._finished_async)
        self._finished_async = []
        index = self.index
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            request = self._reqs.get(req_id)
            if request is None:
                continue
            # Decode steps rarely fill a block: decided before any key.
            due = index.saves_due(
                req_id, request.num_computed_tokens, n_sched, self.num_keys(request)
            )
            if due is None:
                continue
            first, full = due
            groups, skipped, promoted = index.reserve_saves(
                req_id,
                self.keys(request, first, full),
                first,
                kv_cache_manager.get_block_ids(req_id),
                getattr(request, "cache_salt", None),
            )
            for g, window in enumerate(self.windows):
                if window is not None:
                    self.stats.add(f"group{g}.skipped_blocks", skipped[g])
            if promoted:
                self.stats.add("promoted_blocks", promoted)
            for g, positions, slots, ids, events in groups:
                # What this reservation evicted is removed before it is stored.
                self._apply_index_events(events)
                if not slots:
                    continue
                if self.events is not None:
                    self.events.reserved(request, self.keys(request), g, positions)
                meta.saves.append(SaveJob(req_id, tuple(ids), tuple(slots), g))
        return meta

    def update_connector_output(self, meta: HostCacheWorkerMetadata | None) -> None:
        """The workers' confirmations: the index aborts the failed saves,
        makes ready the saves every worker confirmed and releases the loads
        every worker confirmed."""
        if meta is None or not (meta.failed_saves or meta.saved or meta.loaded):
            return
        self._apply_index_events(
            self.index.workers_reported(list(meta.failed_saves), meta.saved, meta.loaded)
        )

    def _apply_index_events(self, events: list[tuple[str, int, bytes, str | None]]) -> None:
        """Count what the index reports it stored and evicted, and hand it
        to vLLM's KV cache events when they are on."""
        if not events:
            return
        stored: Counter[int] = Counter()
        evicted = 0
        for kind, group, _, _ in events:
            if kind == "stored":
                stored[group] += 1
            elif kind == "evicted":
                evicted += 1
        self.stats.add("stored_blocks", sum(stored.values()))
        self.stats.add("evicted_blocks", evicted)
        if self._per_group:
            for g, n in stored.items():
                self.stats.add(f"group{g}.stored_blocks", n)
        if self.events is not None:
            self.events.apply(events)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """The request ends: ``(async_save, params)``. ``async_save`` is True
        while its saves are in flight (vLLM keeps its blocks until the workers
        report it). ``params`` is ``{"host_cache_stats": {...}}`` when the
        request's ``kv_transfer_params`` ask for ``host_cache_stats``. Its
        offer and its loads not yet shipped are released (one Rust call,
        ``HostTier::finished``)."""
        req_id = request.request_id
        self._reqs.pop(req_id, None)
        fin = self.index.finished(req_id)
        asked = getattr(request, "kv_transfer_params", None)
        params = None
        if isinstance(asked, dict) and STATS_KEY in asked:
            params = {STATS_KEY: self._request_stats(fin)}
        if fin is None or not fin[0]:
            return False, params
        self._finished_async.append(req_id)
        return True, params

    def _request_stats(
        self, fin: tuple[bool, int, int, list[int], list[int]] | None
    ) -> dict[str, Any]:
        """A finished request's ``host_cache_stats``; for any layout but the
        plain one (several KV cache groups, or one sliding-window group) also
        ``groups``: each group's kind and its blocks loaded and saved (a
        windowed group's are its windows only)."""
        _, loaded, saved, loaded_g, saved_g = fin or (False, 0, 0, None, None)
        out: dict[str, Any] = {"loaded_tokens": loaded, "saved_blocks": saved}
        if self._per_group:
            out["groups"] = [
                {
                    "kind": kind,
                    "loaded_blocks": loaded_g[g] if loaded_g else 0,
                    "saved_blocks": saved_g[g] if saved_g else 0,
                }
                for g, kind in enumerate(self.kinds)
            ]
        return out

    def reset_cache(self) -> bool:
        self.index.clear_unpinned()
        self._apply_index_events(self.index.take_events())
        return True

    def take_events(self) -> list[Any]:
        """The tier's KV cache events since the last call (none unless
        vLLM's KV cache events are on)."""
        return self.events.take() if self.events is not None else []

    def take_stats(self) -> HostCacheStats | None:
        """This interval's counters, with the tier's gauges whenever they
        changed since the last report (None: nothing to report)."""
        usage = self.index.usage()
        if usage != self._usage:
            self._usage = usage
            self.stats.set_tier(*usage, self.slot_bytes)
        policy = self.index.policy_usage()
        if policy != self._policy_usage:
            self._policy_usage = policy
            self.stats.set_policy(*policy)
        return self.stats.take()

    def num_live_requests(self) -> int:
        return self.index.num_requests
