"""The host tier's scheduler side: what is cached (the Rust block index), what
each request loads, and which full blocks each step saves.

Protocol with the workers (all through vLLM's metadata paths):

- a lookup answers the longest cached prefix in one Rust call;
- an allocation pins the slots to load (they cannot be evicted) and queues a
  :class:`LoadJob`; the worker's confirmation unpins them;
- each step, the newly full blocks of every scheduled request get reserved
  slots (``Writing``: never readable, never evicted) in a :class:`SaveJob`;
  the slots become readable when every worker confirmed the copy, and are
  freed if one failed;
- a request finishing while its saves are unconfirmed returns
  ``async_save=True``; the workers report it finished sending once its
  copies are done, and vLLM keeps its blocks until then.

Partial blocks are never stored. Block identities are vLLM's block hashes
(prefix-cache identity: salt, LoRA, multimodal inputs); without them (prefix
caching off) a chained hash of the token ids, computed in Rust.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmux._core import HostIndex, chain_token_hashes
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
    inflight: set[int] = field(default_factory=set)
    """Reserved slots whose save is not confirmed yet."""
    loaded_tokens: int = 0
    saved_blocks_new: int = 0
    """Blocks this request added to the tier."""


class HostCacheScheduler:
    def __init__(self, block_size: int, num_slots: int, num_workers: int) -> None:
        self.block_size = block_size
        self.index = HostIndex(num_slots)
        self.num_workers = num_workers
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self._finished_async: list[str] = []
        # slot -> save confirmations still expected from the workers
        self._save_acks: dict[int, int] = {}
        self._slot_owner: dict[int, str] = {}
        # slot -> load confirmations received, not yet a whole set of workers
        self._load_acks: Counter[int] = Counter()
        self.stats = HostCacheStats()

    # -------------------------------------------------------------- keys

    def keys(self, request: Request, start: int = 0, end: int | None = None) -> list[bytes]:
        """The identities of the request's full blocks ``[start, end)``:
        vLLM's block hashes (sliced, not copied whole, when a range is
        asked), else the chained token hash computed in Rust."""
        hashes = request.block_hashes
        if not hashes:
            salt = (getattr(request, "cache_salt", None) or "").encode()
            hashes = chain_token_hashes(list(request.all_token_ids), self.block_size, salt)
        if start == 0 and end is None and isinstance(hashes, list):
            return hashes  # read-only use: the core borrows, never mutates
        return list(hashes[start:end])

    def num_keys(self, request: Request) -> int:
        """How many full blocks have an identity (no hashing, no copy)."""
        return len(request.block_hashes) or len(request.all_token_ids) // self.block_size

    # ------------------------------------------------------------ events

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        keys = self.keys(request)
        hit_blocks = self.index.longest_prefix(keys)
        # vLLM must compute at least the last prompt token itself.
        hit_blocks = min(hit_blocks, (request.num_tokens - 1) // self.block_size)
        external = max(0, hit_blocks * self.block_size - num_computed_tokens)
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request)
        st.lookup_computed = num_computed_tokens
        self.stats.add("lookups", 1)
        self.stats.add("lookup_hit_tokens", external)
        return external, False

    def allocated(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request)
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        start, n = st.lookup_computed // bs, num_external_tokens // bs
        block_ids = blocks.get_block_ids()[0][start : start + n]
        slots = self.index.pin_ready(self.keys(request, start, start + n))
        if slots is None or len(block_ids) != n:
            self.stats.add("load_errors", len(block_ids))
            self._loads.append(LoadJob(request.request_id, (), tuple(block_ids), failed=True))
            return
        self.stats.add("loaded_tokens", num_external_tokens)
        st.loaded_tokens += num_external_tokens
        self._loads.append(LoadJob(request.request_id, tuple(slots), tuple(block_ids)))

    def build_meta(
        self, scheduler_output: SchedulerOutput, kv_cache_manager: Any
    ) -> HostCacheMetadata:
        meta = HostCacheMetadata(loads=self._loads, finished_async=self._finished_async)
        self._loads, self._finished_async = [], []
        bs = self.block_size
        evicted_before = None  # read from the index only on steps that reserve
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            # Decode steps rarely fill a block: decide before touching any key.
            full = min((st.request.num_computed_tokens + n_sched) // bs, self.num_keys(st.request))
            if full <= st.saved_blocks:
                continue
            if evicted_before is None:
                evicted_before = self.index.stats()["evicted"]
            positions, slots = self.index.reserve(self.keys(st.request, st.saved_blocks, full))
            if slots:
                block_ids = kv_cache_manager.get_block_ids(req_id)[0]
                meta.saves.append(
                    SaveJob(
                        req_id,
                        tuple(block_ids[st.saved_blocks + p] for p in positions),
                        tuple(slots),
                    )
                )
                st.inflight.update(slots)
                st.saved_blocks_new += len(slots)
                for s in slots:
                    self._save_acks[s] = self.num_workers
                    self._slot_owner[s] = req_id
            st.saved_blocks = full
        if evicted_before is not None:
            self.stats.add("evicted_blocks", self.index.stats()["evicted"] - evicted_before)
        return meta

    def worker_output(self, meta: HostCacheWorkerMetadata | None) -> None:
        if meta is None:
            return
        if meta.failed_saves:
            self.index.abort(list(meta.failed_saves))
            for s in meta.failed_saves:
                self._forget_save(s)
        done = []
        for s, n in meta.saved.items():
            left = self._save_acks.get(s)
            if left is None:
                continue
            if left - n <= 0:
                done.append(s)
                self._forget_save(s)
            else:
                self._save_acks[s] = left - n
        if done:
            self.stats.add("stored_blocks", self.index.commit(done))
        unpin = []
        for s, n in meta.loaded.items():
            # A load pin is released once every worker has confirmed it.
            loads, self._load_acks[s] = divmod(self._load_acks[s] + n, self.num_workers)
            unpin.extend([s] * loads)
            if not self._load_acks[s]:
                del self._load_acks[s]
        if unpin:
            self.index.unpin(unpin)

    def _forget_save(self, slot: int) -> None:
        self._save_acks.pop(slot, None)
        owner = self._slot_owner.pop(slot, None)
        st = self._reqs.get(owner) if owner is not None else None
        if st is not None:
            st.inflight.discard(slot)

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """The request ends: ``(async_save, params)``. ``async_save`` is True
        while its saves are in flight (vLLM keeps its blocks until the workers
        report it). ``params`` is ``{"host_cache_stats": {...}}`` when the
        request's ``kv_transfer_params`` ask for ``host_cache_stats``."""
        req_id = request.request_id
        st = self._reqs.pop(req_id, None)
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
            params = {
                STATS_KEY: {
                    "loaded_tokens": st.loaded_tokens if st else 0,
                    "saved_blocks": st.saved_blocks_new if st else 0,
                }
            }
        if st is None or not st.inflight:
            return False, params
        self._finished_async.append(req_id)
        return True, params

    def _drop_load(self, job: LoadJob) -> None:
        if not job.failed:
            self.index.unpin(list(job.slots))

    def reset(self) -> bool:
        self.index.clear_unpinned()
        return True

    def num_live_requests(self) -> int:
        return len(self._reqs)
