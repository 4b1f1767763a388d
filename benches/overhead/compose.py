"""C1: what ``load_policy: "compose"`` buys over ``first`` and ``longest``,
with prefixes split between two tiers.

Two children, in this order: ``host``, kvmux's host tier
(``KvmuxHostCache``), holding the first :data:`HOST_BLOCKS` blocks of each
prefix, and ``tier2``, holding every prefix whole: in C1 a second
``KvmuxHostCache`` standing in for a larger, slower tier; in C1L
(:mod:`benches.overhead.compose_lmcache`) the real LMCache, a :class:`Tier2`
given to :func:`build`. Each configuration runs on a fresh scheduler and
fresh children, warmed the same way: every prefix is computed once (both
tiers save it), the host tier is emptied (``reset_cache``), the first halves
are requested again (``tier2`` loads them, the host tier promotes them),
then vLLM's own prefix cache and the paged KV tensors are wiped. The
measured batch then asks for every prefix (plus a few tokens of its own) at
once, and runs until every prompt is computed:

- ``compose``: the host tier loads ``[0, a)``, ``tier2`` only ``[a, b)``;
- ``first`` (vLLM's rule): the host tier has some of each prefix, so it
  loads ``[0, a)`` and vLLM recomputes ``[a, b)``;
- ``longest``: ``tier2`` has more, so it reloads all of ``[0, b)``, the part
  in host memory included.

The figure timed is the time to load, measured the same way for all three
(:class:`LoadClock`): over the measured batch, the seconds during which the
worker-side connector is in a load hook (``start_load_kv``,
``wait_for_layer_load``: where ``KvmuxHostCache`` copies host to device) or
has an asynchronous load outstanding (``num_pending_async_loads() > 0``:
from the ``start_load_kv`` that submits it to the end of the
``get_transfer_results`` (or, before vLLM 0.33, ``get_finished``) that
reports it done, the engine loop's steps and idle polls between included),
counting overlaps once. With only synchronous loaders (C1) that is the time
in the two hooks. The bytes each tier moved (the children's own
``bytes_loaded``; for a tier without that counter, the tokens kvmux credits
it with times the KV bytes per token), the tokens each loaded and the tokens
vLLM recomputed are deterministic; they are in the JSON's notes and the
table's footer. The model is a stand-in (vLLM's real scheduler and
connectors, :class:`tests.support.sim.SchedulerSim`) whose "attention" writes
KV that depends only on the prefix, so ``check`` compares every loaded block
bit for bit with computing it; recomputing costs nothing here, which is why
``first``'s time to load is the least: on a GPU it pays that recomputation
in prefill instead.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import KVTransferConfig

from benches.overhead.case import Case
from tests.support.sim import BLOCK_SIZE, SchedulerSim

__all__ = ["POLICIES", "LoadClock", "Tier2", "build"]

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


@dataclass
class Tier2:
    """The second tier of a C1 variant. The default is C1's: a second
    ``KvmuxHostCache``."""

    key: str = "C1"
    """The case's key (its rows and footer lines)."""
    label: str = "tier2"
    """What the title calls it."""
    connector: str = "KvmuxHostCache"
    entry: Callable[[int], dict[str, Any]] = field(default=lambda room: _child("tier2", room))
    """Its child entry (named ``tier2``), given the blocks of room needed."""
    failure_policy: str | None = None
    """``kv_load_failure_policy`` (None: vLLM's default)."""
    idle_wait_s: float = 0.0
    """How long the engine loop waits after a step that scheduled nothing
    (an asynchronous lookup or load under way)."""
    shared: bool = False
    """True: the tier outlives a configuration's run (a server), so each run
    gets a model folder of its own: a model name, hence cache keys, no
    earlier run used."""
    host_cache: bool = True
    """It is a ``KvmuxHostCache``: it reports ``index_stats()`` and counts
    its ``bytes_loaded``."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Added to the case's notes."""


def _ktc(policy: str, prefixes: int, tier2: Tier2) -> KVTransferConfig:
    # Room for everything in both tiers: what each holds is set by the
    # warm-up, not by eviction, nor by save admission (every child saves
    # every request, so the warm-up fills both tiers as the case says).
    room = 2 * prefixes * PREFIX_BLOCKS + 64
    children = [_child("host", room), tier2.entry(room)]
    ktc = KVTransferConfig(
        kv_connector="KvmuxConnector",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [{**c, "save_policy": "always"} for c in children],
            "load_policy": policy,
        },
    )
    if tier2.failure_policy is not None:
        ktc.kv_load_failure_policy = tier2.failure_policy  # type: ignore[assignment]
    return ktc


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
    only on the prefix (value + layer index), so loads can be checked;
    :meth:`idle` waits ``idle_wait_s``."""

    def __init__(self, ktc: Any, *, idle_wait_s: float = 0.0, **kw: Any) -> None:
        super().__init__(ktc, **kw)
        self.idle_wait_s = idle_wait_s

    def idle(self) -> None:
        if self.idle_wait_s:
            time.sleep(self.idle_wait_s)

    def kv_bytes_per_token(self) -> int:
        """Bytes of paged KV per token, all layers (K and V)."""
        return sum(kv[0, :, 0, :].numel() * kv.element_size() for kv in self.kv_caches.values())

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


class LoadClock:
    """Seconds during which a worker-side connector is loading: inside a
    load hook (:meth:`hook` wraps ``start_load_kv`` and
    ``wait_for_layer_load``), or with an asynchronous load outstanding, until
    the ``get_finished`` or ``get_transfer_results`` (:meth:`poll`) that
    reports the last one done. Overlaps count once."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.seconds = 0.0
        self._since: float | None = None

    def _settle(self) -> None:
        if self._since is not None and not self.worker.num_pending_async_loads():
            self.seconds += time.perf_counter() - self._since
            self._since = None

    @property
    def loading(self) -> bool:
        """A load is under way (a hook running, or one outstanding)."""
        return self._since is not None

    def hook(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._since is None:
                self._since = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._settle()

        return call

    def poll(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                self._settle()

        return call


class Policy:
    """One configuration: each call warms fresh children, loads the batch
    and returns the time to load (:class:`LoadClock`)."""

    def __init__(self, policy: str, prefixes: list[list[int]], tier2: Tier2) -> None:
        self.policy, self.prefixes, self.tier2 = policy, prefixes, tier2
        self.ktc = _ktc(policy, len(prefixes), tier2)
        self._models = (
            tempfile.TemporaryDirectory(prefix="kvmux-bench-c1-") if tier2.shared else None
        )
        self._runs = 0
        self.sim: KVSim | None = None
        self.exact: bool | None = None
        self.moved: dict[str, Any] = {}
        """The last run's bytes and tokens loaded per tier, tokens recomputed."""

    def _run(self, verify: bool) -> float:
        if self.sim is not None:
            self.sim.close()
        n = len(self.prefixes)
        extra: dict[str, Any] = {}
        if self._models is not None:
            self._runs += 1
            extra["model_dir"] = Path(self._models.name) / f"run-{self._runs}"
        # A token budget that prefills the whole batch in one step: no
        # request's prefill is chunked (the workload C1 has always measured;
        # the KV check reads each request's blocks in the step after its
        # prompt is computed, before vLLM frees them).
        sim = self.sim = KVSim(
            self.ktc,
            num_blocks=2 * n * (PREFIX_BLOCKS + 1),  # the batch fits, nothing is preempted
            max_num_seqs=max(16, n),
            max_num_batched_tokens=n * (PREFIX_BLOCKS * BLOCK_SIZE + OWN_TOKENS + 1),
            idle_wait_s=self.tier2.idle_wait_s,
            **extra,
        )
        drain = 120.0  # seconds: a stuck asynchronous tier fails the run, never hangs it
        own = list(range(1, OWN_TOKENS + 1))
        for i, p in enumerate(self.prefixes):
            sim.add(f"warm-{i}", p + own, max_tokens=1)
        sim.run(max_steps=1_000_000, timeout_s=drain)
        sim.connector.children[0].reset_cache()  # the host tier only
        _wipe(sim)
        half = HOST_BLOCKS * BLOCK_SIZE
        for i, p in enumerate(self.prefixes):
            sim.add(f"half-{i}", p[:half] + own, max_tokens=1)
        sim.run(max_steps=1_000_000, timeout_s=drain)
        indexed = sim.connector.children[: 2 if self.tier2.host_cache else 1]
        held = [c.index_stats()["ready"] for c in indexed]
        if held != [n * HOST_BLOCKS, n * PREFIX_BLOCKS][: len(held)]:
            raise RuntimeError(f"{self.policy}: after the warm-up the tiers hold {held} blocks")
        _wipe(sim)
        stats_from = len(sim.kv_stats)
        before = {k: dict(v) for k, v in sim.connector.mux_stats()["children"].items()}

        w = sim.worker
        clock = LoadClock(w)
        w.start_load_kv = clock.hook(w.start_load_kv)
        w.wait_for_layer_load = clock.hook(w.wait_for_layer_load)
        # Where the worker's step collects completed loads (vLLM 0.33's
        # runner: get_transfer_results; older ones: get_finished).
        polls = [h for h in ("get_finished", "get_transfer_results") if hasattr(w, h)]
        for h in polls:
            setattr(w, h, clock.poll(getattr(w, h)))
        want = {"cached_tokens_by_child": True}
        # max_tokens 2: a request lives one step after its prompt is
        # computed, so its blocks can be checked then (with an asynchronous
        # tier, the requests' loads end in different steps).
        reqs = [
            sim.add(f"req-{i}", p + own, max_tokens=2, kv_transfer_params=want)
            for i, p in enumerate(self.prefixes)
        ]
        pending = dict(enumerate(reqs))
        exact = True
        recomputed = 0
        deadline = time.monotonic() + drain
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.policy}: the batch was not computed in {drain} s")
            so = sim.step()
            for rid, k in so.num_scheduled_tokens.items():
                r = sim.requests[rid]
                if rid.startswith("req-"):  # prompt tokens only, not a decode step's
                    recomputed += k - max(0, r.num_computed_tokens - r.num_prompt_tokens)
            for i, r in list(pending.items()):
                if r.num_computed_tokens >= r.num_prompt_tokens:
                    del pending[i]
                    if verify:
                        exact = exact and sim.kv_is_exact(r.request_id, self.prefixes[i])
            if not so.num_scheduled_tokens:
                sim.idle()
        del w.start_load_kv, w.wait_for_layer_load
        for h in polls:
            delattr(w, h)
        if clock.loading:
            raise RuntimeError(f"{self.policy}: a load was still outstanding after the batch")
        if verify:
            self.exact = exact
        sim.run(max_steps=1_000_000, timeout_s=drain)
        after = sim.connector.mux_stats()["children"]
        load_tokens = {k: after[k]["load_tokens"] - before[k]["load_tokens"] for k in NAMES}
        bytes_loaded: dict[str, int | None] = dict.fromkeys(NAMES, None)
        for st in sim.kv_stats[stats_from:]:
            for name, child in st.get("children", {}).items():
                data = child.get("data", {})
                if name in bytes_loaded and "bytes_loaded" in data:
                    bytes_loaded[name] = (bytes_loaded[name] or 0) + data["bytes_loaded"]
        per_token = sim.kv_bytes_per_token()
        # A tier without a byte counter (LMCache's connector): the tokens
        # kvmux credits it with, times the KV bytes per token. A KvmuxHostCache
        # that loaded nothing this batch reported no stats: 0.
        counted = {k: bytes_loaded[k] is not None or load_tokens[k] == 0 for k in NAMES}
        if not self.tier2.host_cache:
            counted["tier2"] = False
        self.moved = {
            "bytes_loaded": {
                k: (bytes_loaded[k] or 0) if counted[k] else load_tokens[k] * per_token
                for k in NAMES
            },
            "bytes_from": {
                k: "the tier's bytes_loaded" if counted[k] else "kvmux's load_tokens x bytes/token"
                for k in NAMES
            },
            "kv_bytes_per_token": per_token,
            "load_tokens": load_tokens,
            "cached_tokens_by_child": [
                sim.finished[f"req-{i}"]["cached_tokens_by_child"] for i in range(n)
            ],
            # The prompt tokens the model computed (one per request at least).
            "recomputed_tokens": recomputed,
        }
        return clock.seconds

    def __call__(self) -> float:
        return self._run(verify=False)

    def check(self) -> dict[str, Any]:
        self._run(verify=True)
        return self.moved


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def build(quick: bool, tier2: Tier2 | None = None) -> Case:
    """C1 (``tier2`` None: a second ``KvmuxHostCache``) or a variant with
    another second tier (C1L: LMCache)."""
    tier2 = tier2 or Tier2()
    key = tier2.key
    n = 8 if quick else 32
    prefixes = workload(n)
    sides = {p: Policy(p, prefixes, tier2) for p in POLICIES}
    compose, first, longest = (sides[p] for p in POLICIES)
    footer: list[str] = []
    notes: dict[str, Any] = {
        "prefixes": n,
        "prefix_blocks": PREFIX_BLOCKS,
        "host_blocks": HOST_BLOCKS,
        "block_size": BLOCK_SIZE,
        "own_tokens": OWN_TOKENS,
        "children": {"host": "KvmuxHostCache", "tier2": tier2.connector},
        "timed": (
            "seconds the worker-side connector is in start_load_kv or wait_for_layer_load "
            "or has an asynchronous load outstanding (until the get_transfer_results or "
            "get_finished that reports it), over the measured batch (fresh, warmed "
            "children per repeat)"
        ),
        **tier2.notes,
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
                if hasattr(c, "index_stats"):
                    st = c.index_stats()
                    if st["pinned"] or st["writing"] or c.num_live_requests():
                        raise RuntimeError(f"{p}: a tier kept state after the run: {st}")
                if getattr(c, "request_trackers", None):  # LMCache's connector
                    raise RuntimeError(f"{p}: a tier kept per-request state after the run")
            if sim.worker.num_pending_async_loads():
                raise RuntimeError(f"{p}: loads still pending after the run")
            for name in NAMES:
                tokens = moved[p]["load_tokens"][name]
                if moved[p]["bytes_loaded"][name] and not tokens:
                    raise RuntimeError(f"{p}: {name} moved bytes for no tokens")
        half, whole = HOST_BLOCKS * BLOCK_SIZE, PREFIX_BLOCKS * BLOCK_SIZE
        split = {"host": half, "tier2": whole - half}
        expected = {
            "compose": {"host": n * half, "tier2": n * (whole - half)},
            "first": {"host": n * half, "tier2": 0},
            "longest": {"host": 0, "tier2": n * whole},
        }
        got = {p: moved[p]["load_tokens"] for p in POLICIES}
        if got != expected:
            raise RuntimeError(f"the tiers did not load the tokens expected {expected}: {got}")
        by_child = moved["compose"]["cached_tokens_by_child"]
        if any({k: v for k, v in c.items() if k in NAMES} != split for c in by_child):
            raise RuntimeError(f"compose did not split the spans {split}: {by_child[:2]}")
        from2 = {p: moved[p]["bytes_loaded"]["tier2"] for p in POLICIES}
        if not from2["compose"] < from2["longest"]:
            raise RuntimeError(f"compose moved no fewer bytes from tier2 than longest: {from2}")
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
                f"{key} {p:<8} bytes loaded: host {_fmt_bytes(m['bytes_loaded']['host'])}, "
                f"tier2 {_fmt_bytes(m['bytes_loaded']['tier2'])}; tokens loaded: "
                f"host {m['load_tokens']['host']}, tier2 {m['load_tokens']['tier2']}; "
                f"recomputed {m['recomputed_tokens']}"
            )
        if not tier2.host_cache:
            footer.append(
                f"{key}: {tier2.connector} counts no bytes: its bytes are the tokens kvmux "
                f"credits it with x {moved['compose']['kv_bytes_per_token']} B of KV per token"
            )

    return Case(
        key=key,
        title=(
            f"time to load {n} prefixes, {HOST_BLOCKS} of {PREFIX_BLOCKS} blocks in the host "
            f"tier, all in {tier2.label}"
        ),
        kvmux=kvmux,
        rival=rival,
        rival_name="kvmux load_policy first (row 'vs first') / longest (row 'vs longest')",
        unit=(
            f"one batch of {n} requests, kvmux load_policy compose, children host + tier2 "
            + (
                "(both KvmuxHostCache); seconds in the worker's load hooks"
                if tier2.host_cache
                else f"(KvmuxHostCache + {tier2.connector}); seconds until the loads are "
                "done (the worker's load hooks and its outstanding asynchronous loads)"
            )
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
