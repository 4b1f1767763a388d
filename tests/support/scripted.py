"""A scripted child connector for kvmux's tests.

It stands in for connectors that cannot run here (a remote P/D peer such as
NIXL, a cache server): a real ``KVConnectorBase_V1`` subclass, built by vLLM's
factory from its ``kv_transfer_config`` like any child, whose answers a test
sets. It records every call so tests can check what kvmux routed to it.

``kv_connector_extra_config`` (all optional):

- ``matched``: tokens reported by ``get_num_new_matched_tokens`` (default 0)
- ``load_async``: report the match as an async load (and answer
  ``may_load_async`` True)
- ``not_ready``: answer ``None`` this many times per request first
- ``async_save``: ``request_finished`` returns True (saves asynchronously)
- ``params``: the dict ``request_finished`` returns (None: no params)
- ``layer_work``: its per-layer hooks do something (record the layer)
- ``fail``: name of a hook that raises ``RuntimeError``
- ``partial_tail``: ``register_finished_partial_tail`` keeps the blocks
- ``hold``: request ids whose async save does not complete until removed
- ``fail_loads``: every load it is chosen for fails (blocks reported as
  load errors, so vLLM recomputes or fails the request)
- ``repeat_completions``: every completion it reports (send or receive) is
  reported again in the next step too (a duplicate)
- ``report_all_finished``: its workers report every finished request
  finished sending, saved or not (as LMCache's do)
- with ``load_async``, its workers report each load finished receiving in
  the step that starts it
- ``hold_loads``: request ids whose async load its workers do not report
  finished receiving until removed (the load is then reported in the next
  step's ``get_finished``)
- ``match_once``: offers ``matched`` until it is told to load the request,
  0 afterwards (as a NIXL decode reads a remote prefill once: vLLM's retry
  after a failed load computes)
- ``fail_recving``: with vLLM 0.33's ``get_transfer_results``, its workers
  report each async load they report finished receiving as failed too (in
  ``failed_recving`` as well, as vLLM's contract says a failed receive is)
- ``hit_source``: its ``_cache_hit_source`` (vLLM 0.33's
  ``CacheHitSource`` value, e.g. ``"p2p"`` as NIXL declares)
- ``hit_split``: what ``get_external_cache_hit_sources`` returns, whatever
  it is asked (a dict of source values to tokens; a wrong sum on purpose)
- ``step_s_per_token``: its ``build_connector_meta`` sleeps this long per
  token the step scheduled (an engine whose compute costs that much)

Its scheduler side records, in ``scheduled``, the tokens of each request it
saw scheduled in ``build_connector_meta`` (what a connector plans saves
from; a request kvmux declined its save of is not there).

Tests may change ``self.script`` (the same dict) at any time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

#: vLLM 0.33's transfer results (failed receives included); None before it.
TransferResults = getattr(_base, "KVConnectorTransferResults", None)


class ScriptedMetadata(KVConnectorMetadata):
    def __init__(
        self, finished: list[str], loads: list[int] | None = None, recving: list[str] | None = None
    ) -> None:
        self.finished = finished
        self.loads = loads or []
        self.recving = recving or []


class ScriptedConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.script: dict[str, Any] = self._kv_transfer_config.kv_connector_extra_config
        if "hit_source" in self.script:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource

            self._cache_hit_source = CacheHitSource(self.script["hit_source"])
        self.calls: list[tuple[str, Any]] = []
        self._lookups: defaultdict[str, int] = defaultdict(int)
        self._asked_from: dict[str, int] = {}  # num_computed_tokens of the last lookup
        self.layers_seen: list[str] = []
        self.completed: list[str] = []  # async saves reported done, in order
        self.scheduled: defaultdict[str, int] = defaultdict(int)  # scheduler: seen scheduled
        self.announced: set[str] = set()  # worker: async saves it was told of
        self.finished_blocks: dict[str, Any] = {}  # request id -> block ids at finish
        self._async_finished: list[str] = []  # scheduler: saves to announce
        self._saving: set[str] = set()  # worker: saves announced, not yet done
        self._loads: list[int] = []  # scheduler: blocks to load this step
        self._recving: list[str] = []  # scheduler: async loads started this step
        self._to_recv: set[str] = set()  # worker: async loads to report
        self._again: tuple[set[str], set[str]] = (set(), set())  # worker: duplicates
        self._failed_loads: set[int] = set()  # worker
        self.told_to_load: set[str] = set()  # scheduler: requests it was given tokens of
        self._block_size = vllm_config.cache_config.block_size
        self._maybe_fail("__init__")

    def _maybe_fail(self, hook: str) -> None:
        if self.script.get("fail") == hook:
            raise RuntimeError(f"scripted failure in {hook}")

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        self._maybe_fail("get_num_new_matched_tokens")
        self.calls.append(("lookup", request.request_id))
        self._asked_from[request.request_id] = num_computed_tokens
        n = self._lookups[request.request_id]
        self._lookups[request.request_id] += 1
        if n < self.script.get("not_ready", 0):
            return None, False
        if "raw_answer" in self.script:
            return self.script["raw_answer"]
        if self.script.get("match_once") and request.request_id in self.told_to_load:
            return 0, False
        # Like a real cache: never the whole prompt (vLLM computes its last token).
        hit = min(self.script.get("matched", 0), request.num_tokens - 1)
        matched = max(0, hit - num_computed_tokens)
        return matched, bool(self.script.get("load_async")) and matched > 0

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34's question on enqueue: with ``load_async``, any request
        it may be asked to load (its loads are all asynchronous)."""
        self._maybe_fail("may_load_async")
        return bool(self.script.get("load_async"))

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> Any:
        self.calls.append(("hit_sources", (request.request_id, num_external_tokens)))
        self._maybe_fail("get_external_cache_hit_sources")
        if "hit_split" in self.script:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource

            return {CacheHitSource(k): n for k, n in self.script["hit_split"].items()}
        return super().get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self._maybe_fail("update_state_after_alloc")
        self.calls.append(("alloc", (request.request_id, num_external_tokens)))
        if num_external_tokens > 0 and blocks is not None:
            # Its span starts where its lookup was asked from (under kvmux's
            # compose, after the children before it).
            start = self._asked_from.get(request.request_id, request.num_computed_tokens)
            first = start // self._block_size
            n = num_external_tokens // self._block_size
            self._loads.extend(blocks.get_block_ids()[0][first : first + n])
        if num_external_tokens > 0 and self.script.get("load_async"):
            self._recving.append(request.request_id)
        if num_external_tokens > 0:
            self.told_to_load.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> ScriptedMetadata:
        if scheduler_output is not None:  # (some tests call it with None)
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                self.scheduled[req_id] += n
            for r in scheduler_output.scheduled_new_reqs:
                self.scheduled[r.req_id] += 0
            for r in scheduler_output.scheduled_cached_reqs.req_ids:
                self.scheduled[r] += 0
            per_token = self.script.get("step_s_per_token")
            if per_token:
                time.sleep(per_token * scheduler_output.total_num_scheduled_tokens)
        # Tell the workers which finished requests this child saves async.
        saving, self._async_finished = self._async_finished, []
        loads, self._loads = self._loads, []
        recving, self._recving = self._recving, []
        return ScriptedMetadata(saving, loads, recving)

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._maybe_fail("request_finished")
        self.calls.append(("finished", request.request_id))
        self.finished_blocks.setdefault(request.request_id, block_ids)
        seen = self._lookups.pop(request.request_id, None) is not None
        if "raw_finish" in self.script:
            return self.script["raw_finish"]
        # Like a real connector, it saves only requests it took part in.
        is_async = bool(self.script.get("async_save")) and seen
        if is_async:
            self._async_finished.append(request.request_id)
        params = self.script.get("params")
        return is_async, (dict(params) if params is not None else None)

    def register_finished_partial_tail(
        self, request: Any, block_ids: Any, partial_tail_offloads: Any
    ) -> bool:
        self._maybe_fail("register_finished_partial_tail")
        self.calls.append(("partial_tail", request.request_id))
        return bool(self.script.get("partial_tail"))

    # worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, ScriptedMetadata):
            raise TypeError(f"got {type(connector_metadata).__name__}, not my metadata")
        super().bind_connector_metadata(connector_metadata)
        self._saving.update(connector_metadata.finished)
        self.announced.update(connector_metadata.finished)
        self._to_recv.update(connector_metadata.recving)
        if self.script.get("fail_loads"):
            self._failed_loads.update(connector_metadata.loads)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._maybe_fail("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._maybe_fail("wait_for_layer_load")
        if self.script.get("layer_work"):
            self.layers_seen.append(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any):
        self._maybe_fail("save_kv_layer")
        if self.script.get("layer_work"):
            self.layers_seen.append(layer_name)

    def wait_for_save(self) -> None:
        self._maybe_fail("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        self._maybe_fail("get_finished")
        self.calls.append(("get_finished", sorted(finished_req_ids)))
        again_snd, again_rcv = self._again
        # A held load stays owed until the test releases it.
        recving = self._to_recv - set(self.script.get("hold_loads", ()))
        self._to_recv -= recving
        done: set[str] = set()
        if self.script.get("async_save"):
            # An async save completes in the step that announces it, unless
            # a test holds it back with "hold".
            held = set(self.script.get("hold", ()))
            done = self._saving - held
            self._saving -= done
            self.completed.extend(sorted(done))
        if self.script.get("report_all_finished"):
            done |= finished_req_ids
        if self.script.get("repeat_completions"):
            self._again = (set(done), set(recving))
        return (done | again_snd) or None, (recving | again_rcv) or None

    if TransferResults is not None:  # vLLM 0.33

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            sending, recving = self.get_finished(finished_req_ids)
            recving = set(recving or ())
            failed = set(recving) if self.script.get("fail_recving") else set()
            return TransferResults(
                finished_sending=set(sending or ()),
                finished_recving=recving,
                failed_recving=failed,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_loads = self._failed_loads, set()
        return failed


class ScriptedHMAConnector(ScriptedConnector, SupportsHMA):
    """The same, declaring hybrid-memory-allocator support."""

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        self.calls.append(("finished_all_groups", (request.request_id, len(block_ids))))
        self.finished_blocks[request.request_id] = block_ids
        return self.request_finished(request, block_ids[0] if block_ids else [])


#: Every MockedConnector handed out, newest last (tests read and configure them).
MOCKS: list[Any] = []


class MockedConnector(KVConnectorBase_V1):
    """A child built as vLLM's own tests build them: the class hands back a
    ``MagicMock(spec_set=KVConnectorBase_V1)`` from ``__new__``, so nothing
    about its hooks can be read from the class. Its answers are whatever a
    test sets on the mock (:data:`MOCKS`)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from unittest.mock import MagicMock

        mock = MagicMock(spec_set=KVConnectorBase_V1)
        mock.get_kv_connector_stats.return_value = None
        mock.get_mem_pool_context.return_value = None
        MOCKS.append(mock)
        return mock
