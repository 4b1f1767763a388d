"""The worker side of :class:`~kvmux.mux.connector.KvmuxConnector`.

:class:`MuxWorker` owns the children (built for the worker role) and the
completions the workers wait for, each with its child's identity (the Rust
``WorkerMux``, ``rust/mux/worker.rs`` over ``rust/mux/completions.rs``): a request saved by k
children is finished sending once each of the k reported it, a load is
finished when the loading child reports it, and a completion from a child
that owed none (a duplicate, a stray, one of a child whose failure on the
request was contained) is dropped and counted, never passed to vLLM. A load
one child reports failed is passed on finished and failed once every loader
of the request reported, so vLLM recomputes it. A load a child with a
``load_timeout_ms`` leaves unfinished past it is failed the same way, at the
first ``get_finished``/``get_transfer_results`` past the deadline, and the
child's late completion is dropped as a stray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmux import _versions
from kvmux._core import WorkerMux
from kvmux.mux.children import Children
from kvmux.mux.config import MuxConfig
from kvmux.mux.metadata import KvmuxMetadata, KvmuxWorkerMetadata
from kvmux.mux.stats import KvmuxStats, build_child_stats

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["MuxWorker"]


class MuxWorker:
    """kvmux's worker-side state: the children, and the Rust ``WorkerMux``
    that tracks the completions and keeps the worker's counters."""

    def __init__(self, cfg: MuxConfig, children: Children) -> None:
        self.children = children
        self.mux = WorkerMux(list(children.names), [spec.load_timeout_ms for spec in cfg.children])

    def own_metadata(self, meta: KVConnectorMetadata) -> KvmuxMetadata:
        if not isinstance(meta, KvmuxMetadata) or len(meta.children) != len(self.children):
            raise TypeError(
                f"kvmux got connector metadata {type(meta).__name__}; the scheduler "
                "and workers must run the same KvmuxConnector configuration"
            )
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        meta = self.own_metadata(connector_metadata)
        if meta.saves or meta.loads:
            # vLLM with failed receives needs no blocks to fail a load.
            blocks = None if _versions.HAS_TRANSFER_RESULTS else meta.load_blocks
            self.mux.expect(meta.saves, meta.loads, blocks)
        for i, child_meta in enumerate(meta.children):
            self.children.call_one(i, "bind_connector_metadata", child_meta)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        meta = self.own_metadata(kv_connector_metadata)
        for i in self.children.active("handle_preemptions"):
            self.children.call_one(i, "handle_preemptions", meta.children[i])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if _versions.HAS_TRANSFER_RESULTS:
            res = self.get_transfer_results(finished_req_ids)
            return res.finished_sending or None, res.finished_recving or None
        answers = self.children.call("get_finished", finished_req_ids)
        done = self.mux.complete_sends([snd for snd, _ in answers])
        recving = self.mux.complete_recvs([rcv for _, rcv in answers])
        return done or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        out = _versions.TransferResults()
        answers = self.children.call("get_transfer_results", finished_req_ids)
        out.finished_sending = self.mux.complete_sends([r.finished_sending for r in answers])
        # A failed receive is one completion of its child (vLLM's contract
        # lists it in both sets); the request is passed on finished, and
        # failed if any of its loaders failed, once the last one reported.
        out.finished_recving, out.failed_recving = self.mux.complete_recv_results(
            [(r.finished_recving, r.failed_recving) for r in answers]
        )
        return out

    def build_connector_worker_meta(self) -> KvmuxWorkerMetadata | None:
        metas = self.children.call("build_connector_worker_meta")
        if all(m is None for m in metas):
            return None
        return KvmuxWorkerMetadata(children=tuple(metas))

    def get_block_ids_with_load_errors(self) -> set[int]:
        # The blocks of loads that missed their load deadline (vLLM without
        # failed receives; empty otherwise).
        failed: set[int] = set(self.mux.take_timed_out_blocks())
        for blocks in self.children.call("get_block_ids_with_load_errors"):
            failed |= set(blocks or ())
        if failed:
            self.mux.count_load_failures(len(failed))
            # A child that saved those device blocks this step (the host
            # tier) copied KV that is not there: it drops those saves.
            for child in self.children.connectors:
                discard = getattr(child, "discard_saves_from", None)
                if callable(discard):
                    discard(failed)
        return failed

    def get_kv_connector_stats(self) -> KvmuxStats | None:
        """The worker's counters of the interval and each child's stats."""
        return build_child_stats(
            self.children.names,
            self.children.call("get_kv_connector_stats"),
            self.mux.take_interval(),
        )
