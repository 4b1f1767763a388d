"""Which planned loads failed, from vLLM's load-error path.

A child whose load fails reports it from the workers, as vLLM's connector
contract asks: the failed blocks in ``get_block_ids_with_load_errors``
(``invalid_block_ids``) or the failed requests in ``failed_recving``. kvmux
passes both to vLLM unchanged (vLLM then recomputes or fails the request,
by its ``kv_load_failure_policy``); on the scheduler side this module maps
them back to the requests whose load failed, so that the tokens vLLM
recomputes do not count in ``num_extra_cached_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["LoadWatch"]


class LoadWatch:
    """The device blocks of every live request with a planned load."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self.blocks: dict[str, Sequence[int]] = {}
        """Request id -> its device blocks (group 0), while its load is watched."""

    def __len__(self) -> int:
        return len(self.blocks)

    def planned(self, req_id: str, blocks: Any) -> None:
        """A load was planned into ``blocks`` (vLLM's ``KVCacheBlocks``)."""
        groups = blocks.get_block_ids() if blocks is not None else ()
        # Block-level errors exist for single-group layouts only (vLLM
        # refuses them otherwise); multi-group failures come as failed_recving.
        self.blocks[req_id] = list(groups[0]) if len(groups) == 1 else []

    def forget(self, req_id: str) -> None:
        self.blocks.pop(req_id, None)

    def check(self, core: Any, invalid_block_ids: Iterable[int], failed_recving: Iterable[str]):
        """Tell the core which loads failed, and how many tokens each lost:
        a request in ``failed_recving`` loses all of them; otherwise every
        token from the first invalid block of its load on."""
        if not (invalid_block_ids or failed_recving) or not self.blocks:
            return  # every step without a load error: nothing to do
        invalid = set(invalid_block_ids or ())
        failed = set(failed_recving or ())
        for req_id, block_ids in list(self.blocks.items()):
            lost = self._lost_tokens(core, req_id, block_ids, invalid, req_id in failed)
            if lost:
                core.load_failed(req_id, lost)
                del self.blocks[req_id]  # reported once; a retry is a new load

    def _lost_tokens(
        self, core: Any, req_id: str, block_ids: Sequence[int], invalid: set[int], failed: bool
    ) -> int:
        planned = core.loading(req_id)
        if planned is None:
            return 0
        local, external = planned
        if failed:
            return external
        bs = self._block_size
        end = local + external
        for idx in range(local // bs, min(len(block_ids), -(-end // bs))):
            if block_ids[idx] in invalid:
                return end - max(local, idx * bs)
        return 0
