"""C1: what ``load_policy: "compose"`` buys over ``first`` and ``longest``,
with prefixes split between two tiers.

Two children, in this order: ``host``, kvmux's host tier
(``KvmuxHostCache``), holding the first :data:`HOST_BLOCKS` blocks of each
prefix, and ``tier2``, a second ``KvmuxHostCache`` standing in for a larger,
slower tier (LMCache, say), holding every prefix whole. Each configuration
runs on a fresh scheduler and fresh children, warmed the same way: every
prefix is computed once (both tiers save it), the host tier is emptied
(``reset_cache``), the first halves are requested again (``tier2`` loads
them, the host tier promotes them), then vLLM's own prefix cache and the
paged KV tensors are wiped. The measured batch then asks for every prefix
(plus a few tokens of its own) at once, and runs until every prompt is
computed:

- ``compose``: the host tier loads ``[0, a)``, ``tier2`` only ``[a, b)``;
- ``first`` (vLLM's rule): the host tier has some of each prefix, so it
  loads ``[0, a)`` and vLLM recomputes ``[a, b)``;
- ``longest``: ``tier2`` has more, so it reloads all of ``[0, b)``, the part
  in host memory included.

The figure timed is the time to load: the seconds the worker-side connector
spends in its load hooks (``start_load_kv`` and ``wait_for_layer_load``,
where ``KvmuxHostCache`` copies host to device) over the measured batch,
measured the same way for all three. The bytes each tier moved (the
children's own ``bytes_loaded``), the tokens each loaded and the tokens
vLLM recomputed are deterministic; they are in the JSON's notes and the
table's footer. The model is a stand-in (vLLM's real scheduler and
connectors, :class:`kvmux.bench.sim.SchedulerSim`) whose "attention" writes
KV that depends only on the prefix, so ``check`` compares every loaded
block bit for bit with computing it; recomputing costs nothing here, which
is why ``first``'s time to load is the least: on a GPU it pays that
recomputation in prefill instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import KVTransferConfig

from kvmux.bench.case import Case
from kvmux.bench.sim import BLOCK_SIZE, SchedulerSim

__all__ = ["POLICIES", "build"]

PREFIX_BLOCKS = 8
"""Blocks of each prefix (``tier2`` holds them all)."""
HOST_BLOCKS = 4
"""Leading blocks of each prefix the host tier holds."""
OWN_TOKENS = 5
"""Tokens of each request after its prefix (a partial block: never cached)."""
POLICIES = ("compose", "first", "longest")
NAMES = ("host", "tier2")


def _child(name: str, num_blocks: int) -> dict[str, Any]:
    return {
        "name": name,
        "kv_connector": "KvmuxHostCache",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_blocks": num_blocks},
    }


def _ktc(policy: str, prefixes: int) -> KVTransferConfig:
    # Room for everything in both tiers: what each holds is set by the
    # warm-up, not by eviction.
    room = 2 * prefixes * PREFIX_BLOCKS + 64
    return KVTransferConfig(
        kv_connector="KvmuxConnector",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [_child("host", room), _child("tier2", room)],
            "load_policy": policy,
        },
    )


def kv_values(tokens: list[int]) -> list[float]:
    """The stand-in model's KV value at each position: a hash of the tokens
    up to it, so equal prefixes have identical KV (as real KV does)."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % 2_147_483_647
        out.append(float(h % 65_521))
    return out


class KVSim(SchedulerSim):
    """:class:`SchedulerSim` whose model writes, per layer, KV that depends
    only on the prefix (value + layer index), so loads can be checked."""

    def _kv_writes(self, so: Any) -> list[tuple[int, int, float]]:
        mgr = self.scheduler.kv_cache_manager
        out = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            start = req.num_computed_tokens - n  # schedule() already advanced it
            block_ids = mgr.get_block_ids(req_id)[0]
            values = kv_values(req.all_token_ids[: start + n])
            for pos in range(start, start + n):
                out.append((block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE, values[pos]))
        return out

    def kv_is_exact(self, req_id: str, tokens: list[int]) -> bool:
        """The paged KV of the request's first ``len(tokens)`` positions is
        what the model writes for them."""
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        rows = torch.tensor([block_ids[p // BLOCK_SIZE] for p in range(len(tokens))])
        offs = torch.tensor([p % BLOCK_SIZE for p in range(len(tokens))])
        want = torch.tensor(kv_values(tokens))
        for layer, kv in enumerate(self.kv_caches.values()):
            got = kv[rows, :, offs, :]  # (positions, kv heads, 2 * head size)
            if not torch.equal(got, (want + layer).view(-1, 1, 1).expand_as(got)):
                return False
        return True


def workload(n: int) -> list[list[int]]:
    """``n`` distinct prefixes of :data:`PREFIX_BLOCKS` blocks."""
    import random

    rng = random.Random(3)
    return [[rng.randrange(1, 1000) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)] for _ in range(n)]


def _wipe(sim: KVSim) -> None:
    """vLLM's own prefix cache and the paged KV tensors, not the tiers."""
    if not sim.scheduler.reset_prefix_cache():
        raise RuntimeError("vLLM's prefix cache could not be reset")
    for kv in sim.kv_caches.values():
        kv.zero_()


class Policy:
    """One configuration: each call warms fresh children, loads the batch
    and returns the seconds spent in the worker's load hooks."""

    def __init__(self, policy: str, prefixes: list[list[int]]) -> None:
        self.policy, self.prefixes = policy, prefixes
        self.ktc = _ktc(policy, len(prefixes))
        self.sim: KVSim | None = None
        self.exact: bool | None = None
        self.moved: dict[str, Any] = {}
        """The last run's bytes and tokens loaded per tier, tokens recomputed."""

    def _run(self, verify: bool) -> float:
        if self.sim is not None:
            self.sim.close()
        n = len(self.prefixes)
        # A token budget that prefills the whole batch in one step: the KV
        # check reads every request's blocks after the batch, and vLLM frees
        # a request's blocks as it ends (in a chunked batch, some requests
        # would end steps earlier).
        sim = self.sim = KVSim(
            self.ktc,
            num_blocks=2 * n * (PREFIX_BLOCKS + 1),  # the batch fits, nothing is preempted
            max_num_seqs=max(16, n),
            max_num_batched_tokens=n * (PREFIX_BLOCKS * BLOCK_SIZE + OWN_TOKENS + 1),
        )
        own = list(range(1, OWN_TOKENS + 1))
        for i, p in enumerate(self.prefixes):
            sim.add(f"warm-{i}", p + own, max_tokens=1)
        sim.run(max_steps=10_000)
        sim.connector.children[0].reset_cache()  # the host tier only
        _wipe(sim)
        half = HOST_BLOCKS * BLOCK_SIZE
        for i, p in enumerate(self.prefixes):
            sim.add(f"half-{i}", p[:half] + own, max_tokens=1)
        sim.run(max_steps=10_000)
        held = [c.index_stats()["ready"] for c in sim.connector.children]
        if held != [n * HOST_BLOCKS, n * PREFIX_BLOCKS]:
            raise RuntimeError(f"{self.policy}: after the warm-up the tiers hold {held} blocks")
        _wipe(sim)
        stats_from = len(sim.kv_stats)
        before = {k: dict(v) for k, v in sim.connector.mux_stats()["children"].items()}

        # Time the worker's load hooks (outermost calls only).
        w = sim.worker
        spent = [0.0]

        def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[0] += time.perf_counter() - t0

            return call

        w.start_load_kv = timed(w.start_load_kv)  # type: ignore[method-assign]
        w.wait_for_layer_load = timed(w.wait_for_layer_load)  # type: ignore[method-assign]
        want = {"cached_tokens_by_child": True}
        reqs = [
            sim.add(f"req-{i}", p + own, max_tokens=1, kv_transfer_params=want)
            for i, p in enumerate(self.prefixes)
        ]
        computed_before = 0
        for _ in range(10_000):
            if all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
                break
            so = sim.step()
            computed_before += sum(
                n for rid, n in so.num_scheduled_tokens.items() if rid.startswith("req-")
            )
        else:
            raise TimeoutError(f"{self.policy}: the batch was never computed")
        del w.start_load_kv, w.wait_for_layer_load
        if verify:
            self.exact = all(sim.kv_is_exact(f"req-{i}", p) for i, p in enumerate(self.prefixes))
        sim.run(max_steps=10_000)
        bytes_loaded = dict.fromkeys(NAMES, 0)
        for st in sim.kv_stats[stats_from:]:
            for name, child in st.get("children", {}).items():
                bytes_loaded[name] += child.get("data", {}).get("bytes_loaded", 0)
        after = sim.connector.mux_stats()["children"]
        self.moved = {
            "bytes_loaded": bytes_loaded,
            "load_tokens": {k: after[k]["load_tokens"] - before[k]["load_tokens"] for k in NAMES},
            "cached_tokens_by_child": [
                sim.finished[f"req-{i}"]["cached_tokens_by_child"] for i in range(n)
            ],
            # The prompt tokens the model computed (one per request at least).
            "recomputed_tokens": computed_before,
        }
        return spent[0]

    def __call__(self) -> float:
        return self._run(verify=False)

    def check(self) -> dict[str, Any]:
        self._run(verify=True)
        return self.moved


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def build(quick: bool) -> Case:
    n = 8 if quick else 32
    prefixes = workload(n)
    sides = {p: Policy(p, prefixes) for p in POLICIES}
    compose, first, longest = (sides[p] for p in POLICIES)
    footer: list[str] = []
    notes: dict[str, Any] = {
        "prefixes": n,
        "prefix_blocks": PREFIX_BLOCKS,
        "host_blocks": HOST_BLOCKS,
        "block_size": BLOCK_SIZE,
        "own_tokens": OWN_TOKENS,
        "children": {"host": "KvmuxHostCache", "tier2": "KvmuxHostCache"},
        "timed": (
            "seconds in the worker-side connector's start_load_kv and wait_for_layer_load "
            "over the measured batch (fresh, warmed children per repeat)"
        ),
    }

    def kvmux() -> dict[str, float]:
        t = compose()
        return {"vs first": t, "vs longest": t}

    def rival() -> dict[str, float]:
        return {"vs first": first(), "vs longest": longest()}

    def check() -> None:
        moved = {p: sides[p].check() for p in POLICIES}
        for p in POLICIES:
            side = sides[p]
            if not side.exact:
                raise RuntimeError(f"{p}: the loaded KV differs from computing it")
            sim = side.sim
            if sim is None or sim.connector.num_live_requests():
                raise RuntimeError(f"{p}: kvmux kept per-request state after the run")
            for c in sim.connector.children:
                st = c.index_stats()
                if st["pinned"] or st["writing"] or c.num_live_requests():
                    raise RuntimeError(f"{p}: a tier kept state after the run: {st}")
            if sim.worker.num_pending_async_loads():
                raise RuntimeError(f"{p}: loads still pending after the run")
            for name in NAMES:
                tokens = moved[p]["load_tokens"][name]
                if moved[p]["bytes_loaded"][name] and not tokens:
                    raise RuntimeError(f"{p}: {name} moved bytes for no tokens")
        half, whole = HOST_BLOCKS * BLOCK_SIZE, PREFIX_BLOCKS * BLOCK_SIZE
        split = {"host": half, "tier2": whole - half}
        by_child = moved["compose"]["cached_tokens_by_child"]
        if any({k: v for k, v in c.items() if k in NAMES} != split for c in by_child):
            raise RuntimeError(f"compose did not split the spans {split}: {by_child[:2]}")
        tier2 = {p: moved[p]["bytes_loaded"]["tier2"] for p in POLICIES}
        if not tier2["compose"] < tier2["longest"]:
            raise RuntimeError(f"compose moved no fewer bytes from tier2 than longest: {tier2}")
        tokens = {p: sum(moved[p]["load_tokens"].values()) for p in POLICIES}
        if not tokens["compose"] > tokens["first"]:
            raise RuntimeError(f"compose loaded no more tokens from the tiers than first: {tokens}")
        notes["moved"] = {
            p: {k: v for k, v in moved[p].items() if k != "cached_tokens_by_child"}
            for p in POLICIES
        }
        footer.clear()
        for p in POLICIES:
            m = moved[p]
            footer.append(
                f"C1 {p:<8} bytes loaded: host {_fmt_bytes(m['bytes_loaded']['host'])}, "
                f"tier2 {_fmt_bytes(m['bytes_loaded']['tier2'])}; tokens loaded: "
                f"host {m['load_tokens']['host']}, tier2 {m['load_tokens']['tier2']}; "
                f"recomputed {m['recomputed_tokens']}"
            )

    return Case(
        key="C1",
        title=(
            f"time to load {n} prefixes, {HOST_BLOCKS} of {PREFIX_BLOCKS} blocks in the host "
            "tier, all in tier2"
        ),
        kvmux=kvmux,
        rival=rival,
        rival_name="kvmux load_policy first (row 'vs first') / longest (row 'vs longest')",
        unit=(
            f"one batch of {n} requests, kvmux load_policy compose, children host + tier2 "
            "(both KvmuxHostCache); seconds in the worker's load hooks"
        ),
        target=None,
        self_timed=True,
        figures=("vs first", "vs longest"),
        repeats=10,
        warmup=1,
        check=check,
        notes=notes,
        footer=footer,
    )
