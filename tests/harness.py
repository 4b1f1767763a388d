"""Real vLLM objects for kvmux's tests: configs, requests, the v1 scheduler.

Nothing here fakes vLLM; the only stand-in is the model runner (there is no
GPU and no model in a scheduler-level test): :func:`fake_model_output` builds
the ``ModelRunnerOutput`` a worker would return, as vLLM's own tests do.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
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

BLOCK_SIZE = 16
NUM_BLOCKS = 128
NUM_LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 32


def tiny_model_dir() -> str:
    """A folder with only a tiny Llama config.json: enough for ModelConfig."""
    root = Path(os.environ.get("KVMUX_TEST_CACHE", tempfile.gettempdir())) / "kvmux-tiny-llama"
    root.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": KV_HEADS * 2 * HEAD_SIZE,
        "intermediate_size": 256,
        "num_attention_heads": KV_HEADS * 2,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "vocab_size": 1024,
        "max_position_embeddings": 1024,
        "torch_dtype": "float32",
    }
    (root / "config.json").write_text(json.dumps(cfg))
    return str(root)


def child(name: str, **extra: Any) -> dict[str, Any]:
    """A child kv_transfer_config dict."""
    d: dict[str, Any] = {"kv_connector": name, "kv_role": "kv_both"}
    if name.startswith("Kvmux") or name.startswith("Scripted") or extra.pop("kvmux_tests", False):
        d["kv_connector_module_path"] = extra.pop("module", "kvmux")
    if "module" in extra:
        d["kv_connector_module_path"] = extra.pop("module")
    if extra:
        d["kv_connector_extra_config"] = extra
    return d


def scripted(**extra: Any) -> dict[str, Any]:
    """A child from tests/scripted.py (a connector whose answers a test sets)."""
    d = {"kv_connector": "ScriptedConnector", "kv_role": "kv_both",
         "kv_connector_module_path": "scripted"}
    d["kv_connector_extra_config"] = extra
    return d


def mux_config(children: list[dict[str, Any]], name: str = "KvmuxConnector",
               **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path="kvmux" if name != "MultiConnector" or extra.pop(
            "via_kvmux", True) else None,
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


def vllm_config(ktc: KVTransferConfig | None, *, hma: bool = False,
                max_num_seqs: int = 16, max_num_batched_tokens: int = 1024) -> VllmConfig:
    model = ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=True, dtype="float32",
                        max_model_len=1024, seed=0)
    cfg = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=ktc,
    )
    # On this platform vLLM always turns the hybrid manager off; tests of the
    # HMA path turn it back on after construction.
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = not hma
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return cfg


def kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS,
                             head_size=HEAD_SIZE, dtype=torch.float32)
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=page * num_blocks * len(layers), layers=layers,
                          layer_stride=page * num_blocks, block_stride=page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


_HASHER = None


def make_request(req_id: str, tokens: Iterable[int], *, max_tokens: int = 4,
                 kv_transfer_params: dict[str, Any] | None = None) -> Request:
    global _HASHER
    if _HASHER is None:
        init_none_hash(sha256)
        _HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": kv_transfer_params}
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params,
                   pooling_params=None, block_hasher=_HASHER)


def make_scheduler(cfg: VllmConfig, num_blocks: int = NUM_BLOCKS) -> Scheduler:
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def fake_model_output(sched_out: Any, *, token: int = 7,
                      kv_out: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    """What a worker's model runner returns for a step: one sampled token per
    scheduled request. (Stand-in for the model: there is none on this machine.)"""
    req_ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv_out,
    )
