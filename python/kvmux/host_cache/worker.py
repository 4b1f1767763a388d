"""The host tier's worker side: applies each step's loads and saves with the
torch copy path (:mod:`kvmux.host_cache.transfer`) and reports completions."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch

from kvmux.host_cache.metadata import HostCacheMetadata, HostCacheWorkerMetadata, SaveJob
from kvmux.host_cache.stats import HostCacheStats
from kvmux.host_cache.transfer import HostPool, Transfer

logger = logging.getLogger("kvmux.host_cache")

__all__ = ["HostCacheWorker"]


class HostCacheWorker:
    def __init__(
        self,
        num_device_blocks: int,
        num_slots: int,
        block_bytes: int,
        groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        """``block_bytes``: host bytes of one slot per the KV cache config;
        ``groups``: each KV cache group's layer names (None: one group of
        every registered layer)."""
        self.num_device_blocks = num_device_blocks
        self.num_slots = num_slots
        self.expected_block_bytes = block_bytes
        self.groups = None if groups is None else [list(g) for g in groups]
        self.pool: HostPool | None = None
        self._meta: HostCacheMetadata | None = None
        # In-flight saves: (transfer, {req_id: slots}) in issue order.
        self._saves: list[tuple[Transfer, dict[str, tuple[int, ...]]]] = []
        self._loads: list[tuple[Transfer, tuple[int, ...]]] = []
        self._awaiting: set[str] = set()
        self._out = HostCacheWorkerMetadata()
        self._load_errors: set[int] = set()
        # Slots of the bound step's saves dropped before they were issued.
        self._discarded: set[int] = set()
        self.stats = HostCacheStats()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        pool = HostPool(kv_caches, self.num_device_blocks, self.num_slots, groups=self.groups)
        if pool.block_bytes != self.expected_block_bytes:
            raise ValueError(
                f"KvmuxHostCache: the registered KV caches hold {pool.block_bytes} bytes per "
                f"block but the KV cache config says {self.expected_block_bytes} (the largest "
                "KV cache group's block); the host tier cannot size its pool consistently "
                "with the scheduler"
            )
        self.pool = pool
        logger.info(
            "KvmuxHostCache: %d host blocks of %d bytes (%.2f GiB, %s) for %d layers "
            "in %d KV cache group(s) on %s",
            pool.num_slots,
            pool.block_bytes,
            pool.nbytes / (1 << 30),
            "pinned" if pool.is_cuda else "pageable",
            len(pool.layers),
            len(pool.groups),
            pool.device,
        )

    def bind_connector_metadata(self, meta: HostCacheMetadata) -> None:
        if self.pool is not None:
            self.pool.fence()
        self._meta = meta
        self._discarded = set()
        self._awaiting.update(meta.finished_async)

    def clear_connector_metadata(self) -> None:
        self._meta = None
        self._discarded = set()

    def _need_pool(self) -> HostPool:
        if self.pool is None:
            raise RuntimeError(
                "KvmuxHostCache got copy work before register_kv_caches; vLLM registers "
                "the KV caches before the first step"
            )
        return self.pool

    def start_load_kv(self) -> None:
        """This step's loads: one batched copy per KV cache group."""
        meta = self._meta
        if meta is None or not meta.loads:
            return
        by_group: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        for job in meta.loads:
            if job.failed:
                self._load_errors.update(job.blocks)
            else:
                slots, blocks = by_group[job.group]
                slots.extend(job.slots)
                blocks.extend(job.blocks)
        for group, (slots, blocks) in by_group.items():
            if not blocks:
                continue
            try:
                transfer = self._need_pool().load(slots, blocks, group)
            except Exception as e:
                if self.groups is not None and len(self.groups) > 1:
                    # vLLM maps block-level load errors back to requests only
                    # for one KV cache group; it would fail on them anyway.
                    raise RuntimeError(
                        f"KvmuxHostCache: load of {len(blocks)} blocks into KV cache group "
                        f"{group} failed ({type(e).__name__}: {e}); vLLM cannot recompute "
                        "failed blocks of a model with several KV cache groups"
                    ) from e
                logger.exception(
                    "KvmuxHostCache: load of %d blocks failed; vLLM recomputes them", len(blocks)
                )
                self._load_errors.update(blocks)
                transfer = Transfer(0)
            self.stats.add("bytes_loaded", transfer.nbytes)
            self._loads.append((transfer, tuple(slots)))

    def wait_for_save(self) -> None:
        """This step's saves: one batched copy per KV cache group."""
        meta = self._meta
        if meta is None or not meta.saves:
            return
        jobs: dict[int, list[SaveJob]] = defaultdict(list)
        for job in meta.saves:
            jobs[job.group].append(job)
        drop = self._discarded
        for group, group_jobs in jobs.items():
            blocks: list[int] = []
            slots: list[int] = []
            owners: dict[str, tuple[int, ...]] = {}
            for job in group_jobs:
                job_blocks, job_slots = job.blocks, job.slots
                if drop:
                    kept = [
                        (b, s) for b, s in zip(job_blocks, job_slots, strict=True) if s not in drop
                    ]
                    job_blocks = tuple(b for b, _ in kept)
                    job_slots = tuple(s for _, s in kept)
                blocks.extend(job_blocks)
                slots.extend(job_slots)
                owners[job.req_id] = owners.get(job.req_id, ()) + job_slots
            if not blocks:
                continue
            try:
                transfer = self._need_pool().save(blocks, slots, group)
            except Exception:
                logger.exception(
                    "KvmuxHostCache: save of %d blocks failed; dropping them", len(blocks)
                )
                self._out.failed_saves.update(slots)
                continue
            self.stats.add("bytes_saved", transfer.nbytes)
            self._saves.append((transfer, owners))

    def _poll(self) -> None:
        while self._saves and self._saves[0][0].done():
            _, owners = self._saves.pop(0)
            for slots in owners.values():
                self._out.saved.update(slots)
        while self._loads and self._loads[0][0].done():
            _, slots = self._loads.pop(0)
            self._out.loaded.update(slots)

    def finished_sending(self) -> set[str]:
        """Requests that finished asynchronously and whose saves are done."""
        self._poll()
        if not self._awaiting:
            return set()
        busy = {r for _, owners in self._saves for r in owners}
        done = self._awaiting - busy
        self._awaiting -= done
        return done

    def build_connector_worker_meta(self) -> HostCacheWorkerMetadata | None:
        self._poll()
        out, self._out = self._out, HostCacheWorkerMetadata()
        return None if out.is_empty() else out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def discard_saves_from(self, blocks: set[int]) -> int:
        """Device ``blocks`` failed to load this step (their KV is not
        there; vLLM recomputes them): this step's saves copy them, so those
        slots are reported failed, never committed, and the tier never
        serves what it did not hold. Returns how many slots. (The step's
        saves are read from its metadata, still bound: vLLM asks for load
        errors before it clears it.) vLLM 0.34 with a drafter asks before
        the step's saves run (it defers ``wait_for_save`` until after the
        drafter): those slots are then left out of the copy as well, since
        the scheduler frees them as soon as it hears they failed."""
        meta = self._meta
        if meta is None:
            return 0
        bad = {
            slot
            for job in meta.saves
            for b, slot in zip(job.blocks, job.slots, strict=True)
            if b in blocks
        }
        if not bad:
            return 0
        self._discarded |= bad  # saves not issued yet skip them
        for _, owners in self._saves:
            for req, slots in owners.items():
                owners[req] = tuple(s for s in slots if s not in bad)
        for slot in bad:
            self._out.saved.pop(slot, None)
        self._out.failed_saves.update(bad)
        return len(bad)

    def shutdown(self) -> None:
        for transfer, _ in self._saves + self._loads:
            transfer.wait()
        self._poll()
