"""Test helpers over :mod:`tests.support.sim` (vLLM's real scheduler in one
process): a stand-in model that writes KV, so loaded blocks can be checked
bit for bit; a hybrid KV cache; child configs, including the scripted
children of ``tests/support/scripted.py``."""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
from vllm.config import KVTransferConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

from tests.support import sim
from tests.support.sim import (  # noqa: F401 - re-exported for the tests
    BLOCK_SIZE,
    HEAD_SIZE,
    KV_HEADS,
    NUM_BLOCKS,
    NUM_LAYERS,
    fake_model_output,
    kv_cache_config,
    layer_names,
    make_kv_caches,
    make_request,
    make_scheduler,
    vllm_config,
    worker_step,
)

#: The module path of the scripted children (``tests/support/scripted.py``) and of
#: the one no-op child (``tests.support.children``), for ``child(..., module=)``.
SCRIPTED = "tests.support.scripted"
NOOP = "tests.support.children"


def kv_values(tokens: Any) -> list[float]:
    """The stand-in model's KV value of each position: a hash of the tokens
    up to it, so equal prefixes have bit-identical KV (as real KV does)."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % 2_147_483_647
        out.append(float(h % 65_521))
    return out


class SchedulerSim(sim.SchedulerSim):
    """:class:`tests.support.sim.SchedulerSim` with a stand-in model whose
    "attention" writes, per layer, KV that depends only on the prefix
    (:func:`kv_values`), so every loaded block can be checked bit for bit.

    ``write_kv=False``: no writes. ``idle_wait_s``: how long :meth:`idle`
    waits after a step that scheduled nothing, as an engine's busy loop would
    pass time while a connector's asynchronous lookup or load (e.g.
    LMCache's) is under way.
    """

    def __init__(
        self, ktc: Any, *, write_kv: bool = True, idle_wait_s: float = 0.0, **kw: Any
    ) -> None:
        super().__init__(ktc, **kw)
        self.write_kv = write_kv
        self.idle_wait_s = idle_wait_s

    def _kv_writes(self, so: Any) -> list[tuple[int, int, float]]:
        """Every token computed this step gets its KV value."""
        if not self.write_kv:
            return []
        mgr = self.scheduler.kv_cache_manager
        out = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(req_id)
            if req is None or req.is_finished():  # aborted since it was scheduled
                continue
            start = req.num_computed_tokens - n  # schedule() already advanced it
            block_ids = mgr.get_block_ids(req_id)[0]
            for pos, value in enumerate(kv_values(req.all_token_ids[: start + n])):
                if pos >= start:
                    out.append((block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE, value))
        return out

    def expected_kv(self, tokens: list[int], layer: int) -> torch.Tensor:
        """The KV the stand-in model writes for ``tokens`` in ``layer``, as
        (positions, kv_heads, 2 * head_size)."""
        v = torch.tensor([x + layer for x in kv_values(tokens)]).view(-1, 1, 1)
        return v.expand(len(tokens), KV_HEADS, 2 * HEAD_SIZE).clone()

    def device_kv(self, req_id: str, layer: int, num_tokens: int) -> torch.Tensor:
        """What the paged KV cache holds for a request's first tokens."""
        kv = list(self.kv_caches.values())[layer]
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        rows = [kv[block_ids[p // BLOCK_SIZE], :, p % BLOCK_SIZE, :] for p in range(num_tokens)]
        return torch.stack(rows)

    def _run_worker(self, w: Any, kv_caches: dict[str, torch.Tensor], so: Any, writes: Any) -> Any:
        """As the base class, plus the worker's KV cache events of the step
        (``get_kv_connector_kv_cache_events``, which vLLM's model runner
        collects with the rest of the connector's output), pickled as they
        cross from a worker process."""
        out = super()._run_worker(w, kv_caches, so, writes)
        events = w.get_kv_connector_kv_cache_events()
        if events is not None:
            out.kv_connector_output.kv_cache_events = pickle.loads(pickle.dumps(events))
        return out

    def idle(self) -> None:
        """Let ``idle_wait_s`` pass, as an engine loop does between polls."""
        if self.idle_wait_s:
            time.sleep(self.idle_wait_s)


def hybrid_kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """A hybrid model's KV cache: layer 0 full attention, layer 1 a sliding
    window, so two KV cache groups (as vLLM builds for Gemma 3 or gpt-oss)."""
    full, window = layer_names()[:2]
    kw: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": KV_HEADS,
        "head_size": HEAD_SIZE,
        "dtype": torch.float32,
    }
    full_spec = FullAttentionSpec(**kw)
    page = full_spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=page * num_blocks, layers=[name], layer_stride=0, block_stride=page)
            for name in (full, window)
        ],
        kv_cache_groups=[
            KVCacheGroupSpec([full], full_spec),
            KVCacheGroupSpec([window], SlidingWindowSpec(**kw, sliding_window=4 * BLOCK_SIZE)),
        ],
    )


def child(name: str, **extra: Any) -> dict[str, Any]:
    """A child kv_transfer_config dict."""
    d: dict[str, Any] = {"kv_connector": name, "kv_role": "kv_both"}
    module = extra.pop("module", "kvmux" if name.startswith("Kvmux") else None)
    if module:
        d["kv_connector_module_path"] = module
    if extra:
        d["kv_connector_extra_config"] = extra
    return d


def scripted(**extra: Any) -> dict[str, Any]:
    """A child from tests/support/scripted.py (a connector whose answers a test sets)."""
    d = {
        "kv_connector": "ScriptedConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": SCRIPTED,
    }
    d["kv_connector_extra_config"] = extra
    return d


def mux_config(
    children: list[dict[str, Any]], name: str = "KvmuxConnector", **extra: Any
) -> KVTransferConfig:
    """kvmux over ``children`` (``name`` "MultiConnector" is kvmux's alias)."""
    return KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children, **extra},
    )


def upstream_config(children: list[dict[str, Any]]) -> KVTransferConfig:
    """vLLM's own in-tree MultiConnector over the same children."""
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children},
    )
