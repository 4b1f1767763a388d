"""Prefill/decode over HTTP, as it is deployed: two OpenAI-compatible vLLM
servers (the README's "pd-prefill" and "pd-decode" blocks, vLLM's default
multi-process engine: API server, engine core and worker each a process)
and a small proxy in the test, which sends each completion request to the
prefill (one token, ``do_remote_decode``) and then to the decode with the
``kv_transfer_params`` the prefill returned, as vLLM's ``toy_proxy_server.py``
does. The ``openai`` client talks to the proxy only.

Checked: every completion is the single engine's, token for token; the
decode says NIXL supplied what it lacked (``num_extra_cached_tokens``); and
both servers' ``/metrics`` agree: the prefill published every request and
freed it once pulled, the decode loaded every request through NIXL, and
NIXL's own histogram counted one read each. Bounded in time; a failure
shows the servers' log tails.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest

from kvmux.cli import engine as kvmux_engine
from tests.e2e.server import Deadline, Samples, Server, metric, scrape
from tests.pd.pd import (
    MAX_TOKENS,
    PREFILL_PARAMS,
    Reference,
    openai_servers,
    prompts,
    readme_config,
)

START_S = 300  # two multi-process servers on two shared cores: ~1-2 min
BUDGET_S = 200  # requests and metrics, after start-up
NIXL = "NixlConnector"


class _Proxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, prefill: str, decode: str, timeout_s: float) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.prefill, self.decode, self.timeout_s = prefill, decode, timeout_s

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Proxy

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass

    def _reply(self, resp: httpx.Response) -> None:
        self.send_response(resp.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(resp.content)))
        self.end_headers()
        self.wfile.write(resp.content)

    def do_GET(self) -> None:
        self._reply(httpx.get(self.server.decode + self.path, timeout=self.server.timeout_s))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        asked = body.get("kv_transfer_params") or {}
        first = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {**asked, **PREFILL_PARAMS},
        }
        pre = httpx.post(self.server.prefill + self.path, json=first, timeout=self.server.timeout_s)
        if pre.status_code != 200:
            self._reply(pre)
            return
        params = pre.json().get("kv_transfer_params") or {}
        then = {**body, "kv_transfer_params": {**params, **asked}}
        self._reply(
            httpx.post(self.server.decode + self.path, json=then, timeout=self.server.timeout_s)
        )


@dataclass(frozen=True)
class Served:
    prefill: Server
    decode: Server
    deadline: Deadline
    token_ids: list[list[int]]
    kv_transfer_params: list[dict[str, Any]]
    want: list[list[int]]
    base: dict[str, Samples]
    """Both servers' ``/metrics`` before the measured requests."""


def _complete(
    client: openai.OpenAI, model: str, prompt: list[int], deadline: Deadline
) -> tuple[list[int], dict[str, Any]]:
    """One prompt per request (a response carries its first prompt's params)."""
    resp = client.with_options(timeout=deadline.left(60)).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={
            "kv_transfer_params": {"num_extra_cached_tokens": True, "host_cache_stats": True},
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    token_ids = list((resp.choices[0].model_extra or {})["token_ids"])
    return token_ids, (resp.model_extra or {}).get("kv_transfer_params") or {}


def _samples(prefill: Server, decode: Server, deadline: Deadline) -> dict[str, Samples]:
    return {"prefill": scrape(prefill, deadline), "decode": scrape(decode, deadline)}


def _settled(prefill: Server, decode: Server, deadline: Deadline) -> dict[str, Samples]:
    """Both servers' metrics once the prefill has freed every request it
    published (bounded: the last samples either way)."""
    poll = Deadline(deadline.left(30))
    while True:
        samples = _samples(prefill, decode, deadline)
        p = samples["prefill"]
        published = metric(p, "kvmux_async_saves_total", connector=NIXL)
        if metric(p, "kvmux_finished_sending_total") == published or poll.passed:
            return samples
        time.sleep(0.5)


@pytest.fixture(scope="module")
def served(
    model_dir: str, reference: Reference, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    workdir = tmp_path_factory.mktemp("http")
    start = Deadline(START_S)
    batch = prompts(seed=71, n=4)
    specs = {"prefill": readme_config("pd-prefill"), "decode": readme_config("pd-decode")}
    with openai_servers(specs, model_dir, workdir, start, kvmux_engine.SERVER_FLAGS) as servers:
        p, d = servers["prefill"], servers["decode"]
        deadline = Deadline(BUDGET_S)
        proxy = _Proxy(p.base_url, d.base_url, timeout_s=60)
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        try:
            with p.shows_log(), d.shows_log():
                want = reference.token_ids(batch, deadline)
                client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
                model = client.with_options(timeout=deadline.left(30)).models.list().data[0].id
                # A first request opens NIXL's connection (see pd.warm_up); the
                # metrics are counted from after it.
                _complete(client, model, prompts(seed=1002, n=1)[0], deadline)
                base = _settled(p, d, deadline)
                done = [_complete(client, model, prompt, deadline) for prompt in batch]
            ids = [i for i, _ in done]
            params = [k for _, k in done]
            yield Served(p, d, deadline, ids, params, want, base)
        finally:
            proxy.shutdown()
            proxy.server_close()
            thread.join(timeout=10)


def test_completions_through_the_proxy_are_the_single_engines(served: Served):
    with served.prefill.shows_log(), served.decode.shows_log():
        assert served.token_ids == served.want


def test_the_decode_pulled_what_it_lacked_over_nixl(served: Served):
    """The first prompt of each prefix is pulled whole (148 tokens); the
    second finds the prefix in the decode's own prefix cache and pulls the
    rest (20 tokens): ``num_extra_cached_tokens`` says so, and the decode's
    host tier loaded nothing. The client asks for both on every request; the
    proxy passes the ask to both servers, so the prefill's NIXL params and
    its host tier's stats come back merged."""
    with served.decode.shows_log():
        extra = [p["num_extra_cached_tokens"] for p in served.kv_transfer_params]
        assert extra == [148, 148, 20, 20]
        host = [p["host_cache_stats"]["loaded_tokens"] for p in served.kv_transfer_params]
        assert host == [0, 0, 0, 0]


def test_both_servers_metrics_agree(served: Served):
    """The prefill published and freed every request; the decode loaded each
    through NIXL, and NIXL's own histogram counted one read per request."""
    n = len(served.token_ids)
    want = {
        ("prefill", "kvmux_async_saves_total", NIXL): n,
        ("prefill", "kvmux_finished_sending_total", None): n,
        ("decode", "kvmux_loads_total", NIXL): n,
        ("decode", "kvmux_loads_total", "KvmuxHostCache"): 0,
        ("decode", "vllm:nixl_xfer_time_seconds_count", None): n,
    }

    def count(samples: dict[str, Samples], key: tuple[str, str, str | None]) -> float:
        labels = {"connector": key[2]} if key[2] else {}
        return metric(samples[key[0]], key[1], **labels)

    with served.prefill.shows_log(), served.decode.shows_log():
        poll = Deadline(min(60, served.deadline.left()))
        while True:
            samples = _samples(served.prefill, served.decode, served.deadline)
            got = {key: count(samples, key) - count(served.base, key) for key in want}
            if got == want or poll.passed:
                break
            time.sleep(0.5)
        assert got == want
