"""Prefill/decode disaggregation over NIXL in push mode (``NixlPushConnector``:
the prefill writes the KV into the decode's blocks), kvmux on both sides:
the README's "pd-prefill-push" and "pd-decode-push" blocks as written (only
the host tier's capacity swapped), each engine a process of its own, vLLM's
defaults otherwise. Outputs compared token for token with the session's
engine without a connector; the module is bounded in time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.server import Deadline
from tests.pd.pd import (
    ASK,
    Engine,
    Group,
    Nixl,
    Reference,
    child,
    counters,
    idle,
    new_suffix,
    prefill_then_decode,
    prompts,
    readme_config,
    settle,
    warm_engines,
)

START_S = 300  # two engines starting together on two shared cores
TEST_S = 150
PROMPT_TOKENS = 148
NIXL = "NixlPushConnector"
HOST = "KvmuxHostCache"


@dataclass
class Push(Group):
    prefill: Engine
    decode: Engine
    reference: Reference


@pytest.fixture(scope="module")
def push(
    model_dir: str, reference: Reference, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Push]:
    specs = {
        "prefill_push": readme_config("pd-prefill-push"),
        "decode_push": readme_config("pd-decode-push"),
    }
    workdir = tmp_path_factory.mktemp("push")
    with warm_engines(specs, "prefill_push", model_dir, workdir, START_S, TEST_S) as es:
        yield Push(es["prefill_push"], es["decode_push"], reference)


def test_push_mode_kvmux_on_both_sides_loads_each_request_once(push: Push):
    """vllm#53049's scenario: the prefill pushes over NIXL while the decode's
    host tier also holds the prefix. NIXL, listed first on the decode, is the
    one loader: it registers, the prefill writes, the decode reports the
    request received once; the host tier, able to serve, loads nothing, so no
    second load races the push and no late completion reaches the
    scheduler. The prefill frees every block once written and counts each
    request finished sending once; neither side holds anything afterwards."""
    dl = Deadline(TEST_S)
    first = prompts(seed=61, n=2)
    second = [new_suffix(p, seed=62 + i) for i, p in enumerate(first)]
    n = len(first)
    with push.logs():
        want_first = push.reference.token_ids(first, dl)
        want_second = push.reference.token_ids(second, dl)
        doctor = push.prefill.call(
            "check_pair",
            30,
            prefill=readme_config("pd-prefill-push"),
            decode=readme_config("pd-decode-push"),
        )
        assert doctor["problems"] == []
        p0, d0 = push.prefill.state(dl), push.decode.state(dl)
        assert doctor["hma_on"] == [p0["hma_on"], d0["hma_on"]] == [True, True]

        _, dec = prefill_then_decode(push.prefill, push.decode, first, dl, ask=ASK)
        assert [r["token_ids"] for r in dec] == want_first
        assert [r["kv_transfer_params"]["num_extra_cached_tokens"] for r in dec] == [
            PROMPT_TOKENS
        ] * n
        # The decode's host tier saved what was pushed; forget vLLM's own copy.
        assert push.decode.call("reset_prefix_cache", 40, timeout_s=30) is True
        d1 = push.decode.state(dl)

        _, dec = prefill_then_decode(push.prefill, push.decode, second, dl, ask=ASK)
        assert [r["token_ids"] for r in dec] == want_second
        assert [r["kv_transfer_params"]["num_extra_cached_tokens"] for r in dec] == [
            PROMPT_TOKENS
        ] * n
        assert [r["kv_transfer_params"]["host_cache_stats"]["loaded_tokens"] for r in dec] == [
            0
        ] * n
        d2 = settle(push.decode, dl, idle)
        assert child(d2, HOST)["hits"] - child(d1, HOST)["hits"] == n  # the host tier could serve
        assert child(d2, HOST)["loads"] == child(d0, HOST)["loads"]  # but never loaded
        assert child(d2, NIXL)["loads"] - child(d0, NIXL)["loads"] == 2 * n
        assert d2["live_requests"] == 0 and d2["mux_stats"]["pending_async_saves"] == 0

        # The writes are the prefill's: one per request, none failed; each
        # request finished sending once, at the write, not at the lease.
        p2 = settle(
            push.prefill,
            dl,
            lambda s: idle(s)
            and counters(s).get("finished_sending", 0)
            >= counters(p0).get("finished_sending", 0) + 2 * n,
            cap=20,
        )
        assert idle(p2) and p2["live_requests"] == 0
        nixl0, nixl2 = Nixl.of(p0, NIXL), Nixl.of(p2, NIXL)
        assert nixl2.transfers - nixl0.transfers == 2 * n
        assert (nixl2.failed, nixl2.expired) == (nixl0.failed, nixl0.expired)
        sent = counters(p2).get("finished_sending", 0) - counters(p0).get("finished_sending", 0)
        assert sent == 2 * n
