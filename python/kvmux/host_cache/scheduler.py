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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmux._core import HostIndex, chain_token_hashes
from kvmux.errors import KvmuxConfigError
from kvmux.host_cache.events import HostEvents
from kvmux.host_cache.layout import NULL_BLOCK_ID
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


@dataclass
class _Req:
    request: Request
    lookup_computed: int = 0
    """vLLM's local computed tokens at the latest lookup."""
    saved_blocks: int = 0
    """Leading blocks already saved, being saved, or found cached."""
    loaded_tokens: int = 0
    """Tokens this tier supplied the request, each counted once: a request
    preempted and admitted again that reloads a span is not credited twice
    (the union of ``loaded_spans``)."""
    loaded_spans: list[tuple[int, int]] = field(default_factory=list)
    """Token spans ``[start, end)`` this tier loaded, one per admission."""
    loaded_per_group: Counter[int] = field(default_factory=Counter)
    saved_per_group: Counter[int] = field(default_factory=Counter)
    saved_blocks_new: int = 0
    """Blocks this request added to the tier (all groups)."""
    offer: list[tuple[int, list[int]]] = field(default_factory=list)
    """The latest lookup's pinned slots, per group: (first block, slots)."""
    scheduled: bool = False
    """It was scheduled once (what it held then is known)."""
    promoted: tuple[int, int] = (0, 0)
    """Blocks [first, end) another child loaded for it."""
    junctions: set[int] = field(default_factory=set)
    """Block boundaries where the request joined a prefix cached before it:
    the windowed groups keep the window before each."""

    def wants(self, block: int, window: int, block_size: int) -> bool:
        """Whether a group reading ``window`` blocks before a resume point
        keeps the request's ``block``: it lies in the window before a
        junction, or from the window before the prompt's resume point on."""
        replay = (self.request.num_prompt_tokens - 1) // block_size
        if block >= replay - window:
            return True
        return any(j - window <= block < j for j in self.junctions)


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
    ) -> None:
        """``windows``: per KV cache group, None for full attention, else the
        blocks the group reads before a resume point; ``kinds``: the groups'
        kinds, for the stats (see ``layout.py``); ``events``: the tier's KV
        cache events, when vLLM's are on (``events.py``); ``promote``: save
        the blocks other children loaded too; ``slot_bytes``: the host
        memory of one slot, for the tier's gauges; ``hash_lookahead``:
        vLLM's ``num_hash_lookahead_tokens`` (> 0: block hashes cover the
        tokens after each block, and the token-hash fallback is off)."""
        self.block_size = block_size
        self.hash_lookahead = hash_lookahead
        self.windows = list(windows)
        self.kinds = (
            list(kinds)
            if kinds is not None
            else ["full_attention" if w is None else "sliding_window" for w in self.windows]
        )
        try:
            self.index = HostIndex(num_slots, len(self.windows), num_workers)
        except MemoryError as e:
            raise KvmuxConfigError(
                f"KvmuxHostCache: the index of {num_slots} blocks cannot be allocated ({e}); "
                "lower capacity_gib or num_blocks"
            ) from e
        self._multi = len(self.windows) > 1
        # Per-group stats for any layout but the plain one (one full group).
        self._per_group = self._multi or self.windows[0] is not None
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self._finished_async: list[str] = []
        self.stats = HostCacheStats()
        self.slot_bytes = slot_bytes
        self._usage: tuple[int, int, int, list[int]] | None = None  # last reported
        self.events = events
        self.promote = promote

    # -------------------------------------------------------------- keys

    def keys(self, request: Request, start: int = 0, end: int | None = None) -> list[bytes]:
        """The identities of the request's full blocks ``[start, end)``:
        vLLM's block hashes (sliced, not copied whole, when a range is
        asked), else (no lookahead hashes) the chained token hash computed
        in Rust. Under lookahead hashes, only the blocks vLLM hashed."""
        hashes = request.block_hashes
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

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The longest prefix every group can serve beyond vLLM's local hit.
        The slots it offers are pinned until the allocation takes them (or a
        new lookup, or the request's end, releases them): what the tier
        offers, it can load."""
        bs = self.block_size
        start = num_computed_tokens // bs
        # vLLM must compute at least the last prompt token itself.
        cap = (request.num_tokens - 1) // bs
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request)
        self._release_offer(st)
        hit = self.index.servable_prefix(self.keys(request), start, cap, self.windows)
        st.lookup_computed = num_computed_tokens
        st.junctions.update(j for j in (start, hit.prefix_blocks) if j > 0)
        if hit.blocks > start:
            st.offer = self._pin_offer(request, start, hit.blocks)
        external = max(0, hit.blocks * bs - num_computed_tokens) if st.offer else 0
        self.stats.add("lookups", 1)
        self.stats.add("lookup_hit_tokens", external)
        return external, False

    def _pin_offer(self, request: Request, start: int, end: int) -> list[tuple[int, list[int]]]:
        """Pin, per group, the slots a resume at block ``end`` reads beyond
        ``start``: ``(first block, slots)``; empty if one is not ready."""
        keys = self.keys(request, start, end)
        offer: list[tuple[int, list[int]]] = []
        for g, window in enumerate(self.windows):
            first = start if window is None else max(start, end - window)
            slots = self.index.pin_ready(keys if first == start else keys[first - start :], g)
            if slots is None:
                for _, pinned in offer:
                    self.index.unpin(pinned)
                return []
            offer.append((first, slots))
        return offer

    def _release_offer(self, st: _Req) -> None:
        for _, slots in st.offer:  # one Rust call per group, no list built
            self.index.unpin(slots)
        st.offer = []

    def allocated(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks, ``num_external_tokens`` of
        them for the tier to fill. In every group, each such block vLLM
        allocated (a windowed group's are its window; the rest are vLLM's
        null block) gets the offered slot, and the loads are queued; offered
        slots left over are released."""
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request)
        offer, st.offer = st.offer, []
        if num_external_tokens <= 0:
            for _, slots in offer:
                self.index.unpin(slots)
            return
        bs = self.block_size
        start, n = st.lookup_computed // bs, num_external_tokens // bs
        keys = self.keys(request, start, start + n)
        all_ids = blocks.get_block_ids()
        jobs: list[LoadJob] = []
        failed = len(keys) < n
        for g, window in enumerate(self.windows):
            first, slots = offer[g] if offer else (start, [])
            ids = all_ids[g][start : start + n]
            failed |= len(ids) < n
            pairs: list[tuple[int, int]] = []  # (slot, device block)
            extra: list[int] = []  # positions the offer does not cover
            for i, block in enumerate(ids):
                if block == NULL_BLOCK_ID and window is not None:
                    continue  # before the window: vLLM reads nothing there
                j = start + i - first
                if 0 <= j < len(slots):
                    pairs.append((slots[j], block))
                else:
                    extra.append(i)
            used = {slot for slot, _ in pairs}
            self.index.unpin([s for s in slots if s not in used])
            if extra and not failed:
                # Not offered (vLLM allocates what the lookup answered, so
                # this is a safety net): pin them now if they are ready.
                more = self.index.pin_ready([keys[i] for i in extra], g)
                if more is None:
                    failed = True
                else:
                    pairs.extend(zip(more, (ids[i] for i in extra), strict=True))
            if pairs:
                jobs.append(
                    LoadJob(
                        request.request_id,
                        tuple(s for s, _ in pairs),
                        tuple(b for _, b in pairs),
                        g,
                    )
                )
        if failed:
            self._load_not_offered(request, jobs, all_ids, start, n)
            return
        self.stats.add("loaded_tokens", num_external_tokens)
        st.loaded_spans.append((st.lookup_computed, st.lookup_computed + num_external_tokens))
        st.loaded_tokens = _union_length(st.loaded_spans)
        for job in jobs:
            # Per group, the largest admission's (a reload is not added).
            st.loaded_per_group[job.group] = max(st.loaded_per_group[job.group], len(job.blocks))
            if self._per_group:
                self.stats.add(f"group{job.group}.loaded_blocks", len(job.blocks))
        self._loads.extend(jobs)

    def _load_not_offered(
        self, request: Request, jobs: list[LoadJob], all_ids: Any, start: int, n: int
    ) -> None:
        """Some blocks vLLM allocated for the tier to fill are not in the
        tier. With one KV cache group, every block to load is reported as a
        load error, and vLLM recomputes them. With several, vLLM cannot map
        block-level errors back to requests, and loading part of a prefix
        would corrupt it: refuse (the lookup pins what it offers, so this
        takes vLLM allocating what the lookup did not answer)."""
        for job in jobs:
            self.index.unpin(list(job.slots))
        if self._multi:
            raise RuntimeError(
                f"KvmuxHostCache: vLLM allocated blocks for request {request.request_id!r} "
                "that the host tier's lookup did not offer, in a model of "
                f"{len(self.windows)} KV cache groups, where vLLM cannot recompute failed "
                "blocks; this is a bug in kvmux or an unsupported vLLM version: please report it"
            )
        failed = [b for ids in all_ids for b in ids[start : start + n] if b != NULL_BLOCK_ID]
        self.stats.add("load_errors", len(failed))
        self._loads.append(LoadJob(request.request_id, (), tuple(failed), failed=True))

    def _save_positions(self, st: _Req, first: int, n: int, ids: Any, window: int) -> list[int]:
        """Positions in ``[first, first + n)`` (relative to ``first``) whose
        blocks a windowed group keeps and still holds on the device."""
        bs = self.block_size
        return [
            p
            for p in range(n)
            if st.wants(first + p, window, bs)
            and first + p < len(ids)
            and ids[first + p] != NULL_BLOCK_ID
        ]

    def build_meta(
        self, scheduler_output: SchedulerOutput, kv_cache_manager: Any
    ) -> HostCacheMetadata:
        meta = HostCacheMetadata(loads=self._loads, finished_async=self._finished_async)
        self._loads, self._finished_async = [], []
        bs = self.block_size
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            if not st.scheduled:
                # What it holds before its first step beyond vLLM's local
                # hit and this tier's own load, another child loaded.
                st.scheduled = True
                end = st.request.num_computed_tokens // bs
                st.promoted = ((st.lookup_computed + st.loaded_tokens) // bs, end)
                if not self.promote:
                    st.saved_blocks = max(st.saved_blocks, end)
            # Decode steps rarely fill a block: decide before touching any key.
            full = min((st.request.num_computed_tokens + n_sched) // bs, self.num_keys(st.request))
            if full <= st.saved_blocks:
                continue
            first = st.saved_blocks
            keys = self.keys(st.request, first, full)
            all_ids = None
            for g, window in enumerate(self.windows):
                sub = None  # positions a windowed group keeps (None: all)
                if window is not None:
                    if all_ids is None:
                        all_ids = kv_cache_manager.get_block_ids(req_id)
                    sub = self._save_positions(st, first, len(keys), all_ids[g], window)
                    self.stats.add(f"group{g}.skipped_blocks", len(keys) - len(sub))
                got = self.index.reserve(keys if sub is None else [keys[p] for p in sub], g, req_id)
                # What this reservation evicted is removed before it is stored.
                self._apply_index_events(got.events)
                positions, slots = got.positions, got.slots
                if not slots:
                    continue
                if sub is not None:
                    positions = [sub[p] for p in positions]
                lo, hi = st.promoted
                if g == 0 and hi > lo:
                    self.stats.add(
                        "promoted_blocks", sum(1 for p in positions if lo <= first + p < hi)
                    )
                if self.events is not None:
                    self.events.reserved(
                        st.request, self.keys(st.request), g, [first + p for p in positions]
                    )
                if all_ids is None:
                    all_ids = kv_cache_manager.get_block_ids(req_id)
                ids = all_ids[g]
                meta.saves.append(
                    SaveJob(req_id, tuple(ids[first + p] for p in positions), tuple(slots), g)
                )
                st.saved_blocks_new += len(slots)
                st.saved_per_group[g] += len(slots)
            st.saved_blocks = full
        return meta

    def worker_output(self, meta: HostCacheWorkerMetadata | None) -> None:
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

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """The request ends: ``(async_save, params)``. ``async_save`` is True
        while its saves are in flight (vLLM keeps its blocks until the workers
        report it). ``params`` is ``{"host_cache_stats": {...}}`` when the
        request's ``kv_transfer_params`` ask for ``host_cache_stats``."""
        req_id = request.request_id
        st = self._reqs.pop(req_id, None)
        if st is not None:
            self._release_offer(st)
        # Loads allocated but never shipped (aborted within the step).
        kept = []
        for job in self._loads:
            if job.req_id == req_id:
                self._drop_load(job)
            else:
                kept.append(job)
        self._loads = kept
        asked = getattr(request, "kv_transfer_params", None)
        params = None
        if isinstance(asked, dict) and STATS_KEY in asked:
            params = {STATS_KEY: self._request_stats(st)}
        if st is None or not st.saved_blocks_new or not self.index.saving(req_id):
            return False, params
        self._finished_async.append(req_id)
        return True, params

    def _request_stats(self, st: _Req | None) -> dict[str, Any]:
        """A finished request's ``host_cache_stats``; for any layout but the
        plain one (several KV cache groups, or one sliding-window group) also
        ``groups``: each group's kind and its blocks loaded and saved (a
        windowed group's are its windows only)."""
        out: dict[str, Any] = {
            "loaded_tokens": st.loaded_tokens if st else 0,
            "saved_blocks": st.saved_blocks_new if st else 0,
        }
        if self._per_group:
            out["groups"] = [
                {
                    "kind": kind,
                    "loaded_blocks": st.loaded_per_group[g] if st else 0,
                    "saved_blocks": st.saved_per_group[g] if st else 0,
                }
                for g, kind in enumerate(self.kinds)
            ]
        return out

    def _drop_load(self, job: LoadJob) -> None:
        if not job.failed:
            self.index.unpin(list(job.slots))

    def reset(self) -> bool:
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
        return self.stats.take()

    def num_live_requests(self) -> int:
        return len(self._reqs)


def _union_length(spans: list[tuple[int, int]]) -> int:
    """Tokens covered by ``spans`` (half-open ranges), each counted once."""
    total, reach = 0, 0
    for start, end in sorted(spans):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total
